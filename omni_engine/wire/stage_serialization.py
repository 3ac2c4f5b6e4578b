"""Msgpack wire format between the client and stage processes (msgspec).

Modelled on vLLM's ``serial_utils.MsgpackEncoder``: ``encode`` returns a list
of buffers, the msgpack body first and then auxiliary buffers that ZMQ sends
as separate zero-copy frames. Foreign types travel as msgpack ext types with
fixed codes (``CustomType``), so fields typed ``Any`` still decode to the right
Python type. Tensor data travels one of three ways, by size:

* inline in the body (tiny tensors: a separate frame costs more than a copy);
* as its own ZMQ frame, sent and received without a copy;
* in a shared-memory slot leased from the producer's ``ShmPool``, sent as a
  handle. A tensor that already lives in a mapped segment (a slot the
  producer wrote into, or a view this process decoded) is sent as a handle
  to the same bytes, never copied: that is how a large output crosses from
  one stage to the next without the client touching it.

Pickle is off unless explicitly allowed on both ends; an unsupported type is a
``TypeError`` naming it.
"""

from __future__ import annotations

import logging
import pickle
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from msgspec.msgpack import Ext

from omni_engine.connectors.settings import (
    DEFAULT_INLINE_THRESHOLD,
    DEFAULT_SHM_THRESHOLD,
    ConnectorSettings,
)
from omni_engine.connectors.shm import SEGMENT_INDEX, ShmPool
from omni_engine.params import NeutralSamplingParams
from omni_engine.stage_output import REQUEST_OUTPUT_FIELDS, StageRequestOutput
from omni_engine.tracing.stage_timing import StageTiming
from omni_engine.wire.ext_types import (  # noqa: F401 (re-exported: the wire's public names)
    DATACLASS_CODES,
    DATACLASS_FIELDS,
    STRUCT_CODES,
    WIRE_STRUCT_NAMES,
    CustomType,
    DataLocation,
    describe_type,
    register_wire_struct,
    vllm_types_if_imported,
)
from omni_engine.wire.headers import WireFormatError  # noqa: F401
from omni_engine.wire.stage_decoder import (  # noqa: F401
    ForeignShmHandleError,
    ShmViewCallback,
    StageMsgpackDecoder,
)

if TYPE_CHECKING:
    import torch
    from PIL import Image

logger = logging.getLogger(__name__)

# Frames arrive read-only; tensors decoded from them are views, as in vLLM.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

# Plain ints for the hot path (msgspec.msgpack.Ext requires int codes).
_CODE_OMNI_REQUEST_OUTPUT = int(CustomType.OMNI_REQUEST_OUTPUT)
_CODE_REQUEST_OUTPUT = int(CustomType.REQUEST_OUTPUT)
_CODE_TORCH_TENSOR = int(CustomType.TORCH_TENSOR)
_CODE_NDARRAY = int(CustomType.NDARRAY)
_CODE_PIL_IMAGE = int(CustomType.PIL_IMAGE)
_CODE_OMNI_STRUCT = int(CustomType.OMNI_STRUCT)
_CODE_PICKLE = int(CustomType.PICKLE)
_CODE_SAMPLING_PARAMS = int(CustomType.SAMPLING_PARAMS)

_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})

class StageMsgpackEncoder:
    """Encodes messages into ``[body, *aux_frames]``. One per thread."""

    def __init__(
        self,
        *,
        shm_pool: ShmPool | None = None,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        shm_threshold: int = DEFAULT_SHM_THRESHOLD,
        allow_pickle: bool = False,
        share_memory: bool = True,
    ) -> None:
        """``share_memory`` False: no tensor leaves as a shared-memory handle, not even one
        already in a segment (a peer on another host could not map it)."""
        self.shm_pool = shm_pool if share_memory else None
        self.share_memory = share_memory
        self.inline_threshold = inline_threshold
        self.shm_threshold = shm_threshold
        self.allow_pickle = allow_pickle
        # One msgspec encoder per nesting depth: an ext's payload is encoded
        # while the outer encoder is mid-call.
        self._encoders = [msgspec.msgpack.Encoder(enc_hook=self._enc_hook)]
        self._depth = 0
        self._aux: list[Any] | None = None
        # The request that shared-memory slots leased now belong to; set while
        # an OmniRequestOutput's fields are encoded.
        self._owner: str | None = None
        # Traced requests (by id) whose shared-memory bytes are counted into their StageTiming.
        self.shm_meter: dict[str, StageTiming] = {}

    @classmethod
    def from_settings(cls, settings: ConnectorSettings, shm_pool: ShmPool | None = None) -> StageMsgpackEncoder:
        """An encoder with a pipeline's connector settings (its pool only with shared memory on)."""
        return cls(shm_pool=shm_pool, inline_threshold=settings.inline_threshold,
                   shm_threshold=settings.shm_threshold, allow_pickle=settings.allow_pickle,
                   share_memory=settings.use_shm)

    def encode(self, obj: Any, owner: str | None = None) -> list[Any]:
        bufs: list[Any] = [b""]
        self._aux, self._owner = bufs, owner
        try:
            bufs[0] = self._encoders[0].encode(self._wrap_top(obj))
        finally:
            self._aux, self._owner = None, None
        return bufs

    def _wrap_top(self, obj: Any) -> Any:
        """Wrap known structs held directly in a message's fields."""
        if isinstance(obj, msgspec.Struct) and type(obj) not in STRUCT_CODES and type(obj) not in WIRE_STRUCT_NAMES:
            changes = {}
            for name in obj.__struct_fields__:
                value = getattr(obj, name)
                wrapped = self._wrap(value)
                if wrapped is not value:
                    changes[name] = wrapped
            return msgspec.structs.replace(obj, **changes) if changes else obj
        return self._wrap(obj)

    def _wrap(self, value: Any) -> Any:
        """Turn Structs and dataclasses of known types into ext types.

        msgspec encodes those natively without calling ``enc_hook``, which
        would lose their type, so containers are walked for them; a list whose
        first item is a scalar (token ids, floats) is taken as all-scalar and
        not walked, to keep that cost off the hot path (a None first item
        does not count as a scalar).
        """
        cls = type(value)
        if cls in _SCALARS:
            return value
        code = STRUCT_CODES.get(cls)
        if code is not None:
            return Ext(int(code), self._nested(value))
        code = DATACLASS_CODES.get(cls)
        if code is not None:
            return Ext(int(code), self._nested(self._fields(value, DATACLASS_FIELDS[cls])))
        name = WIRE_STRUCT_NAMES.get(cls)
        if name is not None:
            return Ext(_CODE_OMNI_STRUCT, self._nested((name, value)))
        if cls is list or cls is tuple:
            # None first is no sign of an all-scalar list: vLLM's prompt
            # logprobs are [None, {token: Logprob}, ...].
            if not value or (type(value[0]) in _SCALARS and value[0] is not None):
                return value
            return [self._wrap(v) for v in value]
        if cls is dict:
            return {k: self._wrap(v) for k, v in value.items()}
        if cls.__module__.startswith("vllm") and vllm_types_if_imported() is not None and (
                cls in STRUCT_CODES or cls in DATACLASS_CODES):
            # vLLM's classes join the tables when first seen (a process without vLLM has none to send).
            return self._wrap(value)
        return value

    def _nested(self, obj: Any) -> bytes:
        self._depth += 1
        try:
            if self._depth == len(self._encoders):
                self._encoders.append(msgspec.msgpack.Encoder(enc_hook=self._enc_hook))
            return self._encoders[self._depth].encode(obj)
        finally:
            self._depth -= 1

    def _fields(self, obj: Any, names: Sequence[str]) -> list[Any]:
        # Most fields of an output are None or scalars: skip the call to _wrap for them.
        wrap = self._wrap
        return [v if type(v := getattr(obj, name, None)) in _SCALARS else wrap(v) for name in names]

    def _enc_hook(self, obj: Any) -> Any:
        # torch, vLLM and PIL are looked up, never imported: an object of theirs exists only
        # where they are, and a stage that has none of them should not pay for their import.
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj)
        if isinstance(obj, np.ndarray):
            return self._encode_ndarray(obj)
        if isinstance(obj, StageRequestOutput):
            return self._encode_request_output(obj, omni=True)
        vllm_types = vllm_types_if_imported()
        if vllm_types is not None and isinstance(obj, vllm_types.request_output):
            return self._encode_request_output(obj, omni=isinstance(obj, vllm_types.omni_request_output))
        pil = sys.modules.get("PIL.Image")
        if pil is not None and isinstance(obj, pil.Image):
            return self._encode_image(obj)
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, NeutralSamplingParams):
            return Ext(_CODE_SAMPLING_PARAMS, self._nested(obj.fields))
        wrapped = self._wrap(obj)
        if wrapped is not obj:
            return wrapped
        if self.allow_pickle:
            return Ext(_CODE_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        raise TypeError(
            f"cannot serialize an object of type {describe_type(obj)} "
            "for a stage message (pickle is disabled; set OMNI_ENGINE_ALLOW_PICKLE=1 to allow it)"
        )

    def _encode_request_output(self, obj: Any, omni: bool) -> Ext:
        """A vLLM ``RequestOutput`` (ext 108), or an ``OmniRequestOutput`` / ``StageRequestOutput``
        (ext 100: the same fields, then the stage's)."""
        if not omni:
            return Ext(_CODE_REQUEST_OUTPUT, self._nested(self._fields(obj, REQUEST_OUTPUT_FIELDS)))
        # The owner is set before the fields are wrapped: wrapping encodes
        # structs/dataclasses (and the tensors inside them) right away.
        outer_owner, self._owner = self._owner, obj.request_id
        try:
            values = self._fields(obj, REQUEST_OUTPUT_FIELDS)
            values += [obj.stage_id, obj.final_output_type, self._wrap(obj.multimodal_output),
                       getattr(obj, "stage_versions", None) or {}]
            return Ext(_CODE_OMNI_REQUEST_OUTPUT, self._nested(values))
        finally:
            self._owner = outer_owner

    def _encode_tensor(self, t: torch.Tensor) -> Ext:
        import torch

        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        # Conjugate/negative views are lazy bits, not data: materialize them
        # (no-ops otherwise), else view(uint8) refuses the tensor.
        t = t.resolve_conj().resolve_neg().contiguous()
        flat = t.reshape(-1)
        if flat.numel() <= 1:
            # Empty and one-element tensors count as contiguous whatever their
            # strides, but view(uint8) needs stride 1.
            flat = flat.as_strided((flat.numel(),), (1,))
        data = flat.view(torch.uint8).numpy()
        header = [str(t.dtype).removeprefix("torch."), list(t.shape)]
        return Ext(_CODE_TORCH_TENSOR, self._encode_data(header, data))

    def _encode_ndarray(self, a: np.ndarray) -> Ext:
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise TypeError(f"cannot serialize a numpy array of dtype {a.dtype} (object/structured)")
        header = [a.dtype.str, list(a.shape)]  # before ascontiguousarray: it makes 0-d arrays 1-d
        a = np.ascontiguousarray(a)
        return Ext(_CODE_NDARRAY, self._encode_data(header, a.reshape(-1).view(np.uint8)))

    def _encode_image(self, img: Image.Image) -> Ext:
        data = np.frombuffer(img.tobytes(), dtype=np.uint8)
        return Ext(_CODE_PIL_IMAGE, self._encode_data([img.mode, list(img.size)], data))

    def _encode_data(self, header: list[Any], data: np.ndarray) -> bytes:
        """Append where the bytes of ``data`` (1-D uint8, contiguous) travel."""
        nbytes = data.nbytes
        if nbytes < self.inline_threshold:
            header += [DataLocation.INLINE, data.tobytes()]
            return msgspec.msgpack.encode(header)
        found = SEGMENT_INDEX.find(int(data.ctypes.data), nbytes) if self.share_memory else None
        if found is None and self.shm_pool is not None and nbytes >= self.shm_threshold:
            segment = self.shm_pool.lease(nbytes, self._owner or "")
            if segment is not None:
                segment.array[:nbytes] = data
                found = (segment.name, 0)
        elif found is not None and self.shm_pool is not None:
            self.shm_pool.mark_sent(found[0])  # a slot a model wrote its output into (empty_output)
        if found is not None:
            if self.shm_meter and (timing := self.shm_meter.get(self._owner or "")) is not None:
                timing.shm_bytes += nbytes
            header += [DataLocation.SHM, found[0], found[1], nbytes, self._owner]
        else:
            assert self._aux is not None
            self._aux.append(data)
            header += [DataLocation.FRAME, len(self._aux) - 1]
        return msgspec.msgpack.encode(header)
