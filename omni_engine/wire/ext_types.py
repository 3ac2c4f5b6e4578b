"""The wire's msgpack ext types: their codes, and the classes each code stands for.

Our own classes are known at import. vLLM's (``SamplingParams``, ``CompletionOutput``,
``RequestOutput``, ...) are resolved the first time one is needed (``vllm_ext_types``):
a stage that runs no vLLM engine never imports vLLM, whose import costs 5-24 s and a few
hundred MB here, only to name types it never sees. Such a stage answers with the
vLLM-free ``StageRequestOutput`` / ``StageCompletionOutput``, sent as the same exts.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import threading
from typing import Any

import msgspec

from omni_engine.inputs import OmniDiffusionSamplingParams, OmniTextPrompt
from omni_engine.params import SpeechParams
from omni_engine.stage_output import COMPLETION_OUTPUT_FIELDS, StageCompletionOutput


class CustomType(enum.IntEnum):
    """Msgpack ext codes. Wire-visible: never renumber, only append."""

    OMNI_REQUEST_OUTPUT = 100
    OMNI_DIFFUSION_SAMPLING_PARAMS = 101
    OMNI_TEXT_PROMPT = 102
    TORCH_TENSOR = 103
    NDARRAY = 104
    SAMPLING_PARAMS = 105
    PIL_IMAGE = 106
    LORA_REQUEST = 107
    REQUEST_OUTPUT = 108
    COMPLETION_OUTPUT = 109
    OMNI_STRUCT = 110  # a msgspec.Struct registered with register_wire_struct
    PICKLE = 111  # only when pickle is allowed on both ends
    LOGPROB = 112
    FLAT_LOGPROBS = 113
    REQUEST_STATE_STATS = 114
    WEIGHT_VERSION_SPAN = 115


class DataLocation(enum.IntEnum):
    INLINE = 0
    FRAME = 1
    SHM = 2


# The codes whose class is vLLM's on a peer that has vLLM.
VLLM_CODES = frozenset({
    CustomType.OMNI_REQUEST_OUTPUT, CustomType.SAMPLING_PARAMS, CustomType.LORA_REQUEST,
    CustomType.REQUEST_OUTPUT, CustomType.COMPLETION_OUTPUT, CustomType.LOGPROB, CustomType.FLAT_LOGPROBS,
    CustomType.REQUEST_STATE_STATS, CustomType.WEIGHT_VERSION_SPAN,
})

# Structs with their own code. msgspec encodes Structs natively (no enc_hook), which would
# lose their type inside ``Any`` fields, so the encoder wraps them in ext types explicitly.
# Keyed by class for the encoder; vLLM's join when they are resolved.
STRUCT_CODES: dict[type, CustomType] = {
    OmniDiffusionSamplingParams: CustomType.OMNI_DIFFUSION_SAMPLING_PARAMS,
    OmniTextPrompt: CustomType.OMNI_TEXT_PROMPT,
}
# Dataclasses (and classes shaped as one) sent as the tuple of their fields.
DATACLASS_CODES: dict[type, CustomType] = {StageCompletionOutput: CustomType.COMPLETION_OUTPUT}
DATACLASS_FIELDS: dict[type, tuple[str, ...]] = {StageCompletionOutput: COMPLETION_OUTPUT_FIELDS}


# Our own structs that may appear in Any fields (e.g. SpeechParams), by name (ext 110).
WIRE_STRUCTS: dict[str, type[msgspec.Struct]] = {}
WIRE_STRUCT_NAMES: dict[type, str] = {}


def register_wire_struct(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """Let ``cls`` travel in ``Any`` fields with its type (ext 110). Decorator."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    WIRE_STRUCTS[name] = cls
    WIRE_STRUCT_NAMES[cls] = name
    return cls


register_wire_struct(SpeechParams)


@dataclasses.dataclass(frozen=True)
class VLLMExtTypes:
    """vLLM's classes behind the wire's vLLM codes."""

    structs: dict[CustomType, type]
    dataclasses: dict[CustomType, type]
    request_output: type
    omni_request_output: type


_vllm_types: VLLMExtTypes | None = None
_vllm_lock = threading.Lock()


def vllm_ext_types() -> VLLMExtTypes:
    """vLLM's wire classes; imports vLLM the first time (a no-op where it is imported already),
    and from then on the encoder finds them by class."""
    global _vllm_types
    if _vllm_types is not None:
        return _vllm_types
    with _vllm_lock:
        if _vllm_types is None:
            from vllm import SamplingParams
            from vllm.logprobs import FlatLogprobs, Logprob
            from vllm.lora.request import LoRARequest
            from vllm.outputs import CompletionOutput, RequestOutput, WeightVersionSpan
            from vllm.v1.metrics.stats import RequestStateStats

            from omni_engine.outputs import OmniRequestOutput

            types = VLLMExtTypes(
                structs={CustomType.SAMPLING_PARAMS: SamplingParams, CustomType.LORA_REQUEST: LoRARequest},
                dataclasses={
                    CustomType.COMPLETION_OUTPUT: CompletionOutput,
                    CustomType.LOGPROB: Logprob,
                    CustomType.FLAT_LOGPROBS: FlatLogprobs,
                    CustomType.REQUEST_STATE_STATS: RequestStateStats,
                    CustomType.WEIGHT_VERSION_SPAN: WeightVersionSpan,
                },
                request_output=RequestOutput,
                omni_request_output=OmniRequestOutput,
            )
            for code, cls in types.dataclasses.items():
                DATACLASS_FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
                DATACLASS_CODES[cls] = code
            for code, cls in types.structs.items():
                STRUCT_CODES[cls] = code
            _vllm_types = types
    return _vllm_types


def vllm_types_if_imported() -> VLLMExtTypes | None:
    """vLLM's wire classes where this process has imported vLLM (an instance of one can exist
    only then), else None; never imports vLLM itself."""
    if _vllm_types is not None:
        return _vllm_types
    return vllm_ext_types() if "vllm" in sys.modules else None


def ext_name(code: int) -> str:
    try:
        return f"ext {CustomType(code).name}"
    except ValueError:
        return f"ext {code}"


def describe_type(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
