"""Qwen2.5-Omni's thinker as vLLM runs it: vLLM's own model, registered out of tree under our name.

The model is vLLM's ``Qwen2_5OmniThinkerForConditionalGeneration`` unchanged; what differs is the
processing info, which builds transformers' processor without a video processor where torchvision
cannot be imported (``processor.load_processor``). vLLM's multimodal registry keys processors by
model class, so a class of our own (a subclass, registered with ``ModelRegistry``) is how a
different processor is plugged in without touching vLLM's files.

Importing this module imports vLLM's model file, so it is only imported in processes that host
vLLM (the llm stage, its EngineCore, vLLM's registry probe).
"""

from __future__ import annotations

from typing import Any

from omni_engine.models import torchvision_free
from omni_engine.models.qwen2_5_omni.processor import VIDEO_UNSUPPORTED, load_processor
from omni_engine.models.request_tap import RequestTap, record

# Before vLLM's model files: they import the transformers module the stand-in replaces.
torchvision_free.install()

from vllm.model_executor.models.qwen2_5_omni_thinker import (
    Qwen2_5OmniThinkerDummyInputsBuilder,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2_5OmniThinkerMultiModalProcessor,
    Qwen2_5OmniThinkerProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from omni_engine.models.vllm_processing import TorchvisionFreeProcessingInfo


class ThinkerProcessingInfo(TorchvisionFreeProcessingInfo, Qwen2_5OmniThinkerProcessingInfo):
    """vLLM's processing info, with the processor built without torchvision where it must be."""

    video_unsupported = VIDEO_UNSUPPORTED
    load_processor = staticmethod(load_processor)


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2_5OmniThinkerMultiModalProcessor,
    info=ThinkerProcessingInfo,
    dummy_inputs=Qwen2_5OmniThinkerDummyInputsBuilder,
)
class OmniEngineQwen2_5OmniThinker(Qwen2_5OmniThinkerForConditionalGeneration):
    """vLLM's thinker under our architecture name (so our processing info is the one used), which
    also records each position's input embedding and last hidden state for the requests that ask
    (what transformers' ``generate`` hands the talker: ``omni_engine.models.request_tap``).

    The recording runs in this outer forward, which vLLM does not compile (its
    ``support_torch_compile`` is on the inner text model); a full CUDA graph would capture it too
    and is not supported with recording (untested on GPUs).
    """

    def forward(self, input_ids: Any, positions: Any, intermediate_tensors: Any = None,
                inputs_embeds: Any = None, **kwargs: object) -> Any:
        hidden_states = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if RequestTap.current is not None and intermediate_tensors is None:
            if inputs_embeds is None:
                inputs_embeds = self.embed_input_ids(input_ids)
            record(inputs_embeds, hidden_states, positions)
        return hidden_states
