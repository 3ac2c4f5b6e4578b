"""Qwen3-Omni's thinker as vLLM runs it: vLLM's own model, registered out of tree under our name.

The model is vLLM's ``Qwen3OmniMoeThinkerForConditionalGeneration`` unchanged, with two additions:

- its processing info builds transformers' processor without a video processor where torchvision
  cannot be imported (``omni_engine.models.vllm_processing``);
- it records, for the requests that ask (``omni_engine.models.request_tap``), each position's input
  embedding and its hidden state after ``talker_config.accept_hidden_layer`` layers (what
  transformers' ``generate`` hands Qwen3-Omni's talker: ``hidden_states[accept_hidden_layer]``, not
  the last layer's as Qwen2.5-Omni's). vLLM's text model collects that layer as an auxiliary hidden
  state (the mechanism EAGLE-3 uses), summed with its residual, after the layer's deepstack visual
  features are added, as transformers' hidden states are.

Importing this module imports vLLM's model file, so it is only imported in processes that host
vLLM (the llm stage, its EngineCore, vLLM's registry probe).
"""

from __future__ import annotations

from typing import Any

from omni_engine.models import torchvision_free
from omni_engine.models.qwen3_omni_moe.processor import VIDEO_UNSUPPORTED, load_processor
from omni_engine.models.request_tap import RequestTap, record

# Before vLLM's model files: they import the transformers module the stand-in replaces.
torchvision_free.install()

from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_omni_moe_thinker import (
    Qwen3OmniMoeThinkerDummyInputsBuilder,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    Qwen3OmniMoeThinkerMultiModalProcessor,
    Qwen3OmniMoeThinkerProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from omni_engine.models.vllm_processing import TorchvisionFreeProcessingInfo


class ThinkerProcessingInfo(TorchvisionFreeProcessingInfo, Qwen3OmniMoeThinkerProcessingInfo):
    """vLLM's processing info, with the processor built without torchvision where it must be."""

    video_unsupported = VIDEO_UNSUPPORTED
    load_processor = staticmethod(load_processor)


@MULTIMODAL_REGISTRY.register_processor(
    Qwen3OmniMoeThinkerMultiModalProcessor,
    info=ThinkerProcessingInfo,
    dummy_inputs=Qwen3OmniMoeThinkerDummyInputsBuilder,
)
class OmniEngineQwen3OmniMoeThinker(Qwen3OmniMoeThinkerForConditionalGeneration):
    """vLLM's thinker under our architecture name, recording the states the talker reads.

    The recording runs in this outer forward, which vLLM does not compile (its
    ``support_torch_compile`` is on the inner text model); a full CUDA graph would capture it too
    and is not supported with recording (untested on GPUs).
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        talker = getattr(vllm_config.model_config.hf_config, "talker_config", None)
        layers = self.config.text_config.num_hidden_layers
        self.accept_hidden_layer = int(getattr(talker, "accept_hidden_layer", layers))
        if not 0 < self.accept_hidden_layer <= layers:
            raise ValueError(f"talker_config.accept_hidden_layer is {self.accept_hidden_layer}; the thinker "
                             f"has {layers} layers (want 1 to {layers})")
        self.language_model.model.aux_hidden_state_layers = (self.accept_hidden_layer,)

    def forward(self, input_ids: Any, positions: Any, intermediate_tensors: Any = None,
                inputs_embeds: Any = None, **kwargs: object) -> Any:
        if inputs_embeds is None and input_ids is not None and intermediate_tensors is None:
            inputs_embeds = self.embed_input_ids(input_ids)  # recorded below; the model reads the same
        output = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if not isinstance(output, tuple):
            return output  # not the last pipeline rank: intermediate tensors
        hidden_states, (accepted,) = output
        if RequestTap.current is not None:
            record(inputs_embeds, accepted, positions)
        return hidden_states
