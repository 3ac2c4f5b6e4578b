"""vLLM processing info for a Qwen-Omni thinker whose processor is built without torchvision.

vLLM's multimodal registry keys processors by model class, so a family registers its thinker under
a class of its own whose processing info mixes this in ahead of vLLM's: the processor comes from
``omni_engine.models.omni_processor`` where torchvision cannot be imported (video refused by
name), and vLLM's own otherwise. Imports vLLM: only for processes that host it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from vllm.exceptions import VLLMValidationError

from omni_engine.models.omni_processor import has_torchvision

# Construction-time options of the image processor (vLLM passes a model's mm_processor_kwargs).
IMAGE_PROCESSOR_KWARGS = frozenset({"min_pixels", "max_pixels", "size", "patch_size", "merge_size",
                                    "temporal_patch_size"})


class TorchvisionFreeProcessingInfo:
    """Mixed in ahead of a vLLM ``*ProcessingInfo``: without torchvision the model supports no
    video (vLLM then profiles without one, a config need not say ``video: 0``) and a prompt with a
    video is refused with ``video_unsupported``."""

    video_unsupported: ClassVar[str]
    # (model_dir, tokenizer=..., **image options) -> the family's processor without torchvision
    load_processor: ClassVar[Callable[..., Any]]
    _processors: ClassVar[dict[tuple[str, tuple[tuple[str, Any], ...]], Any]] = {}

    def get_supported_mm_limits(self) -> Any:
        limits = dict(super().get_supported_mm_limits())  # type: ignore[misc]
        if not has_torchvision():
            limits["video"] = 0
        return limits

    def validate_num_items(self, modality: str, num_items: int) -> None:
        if modality == "video" and num_items > 0 and not has_torchvision():
            raise VLLMValidationError(self.video_unsupported, parameter="video")
        super().validate_num_items(modality, num_items)  # type: ignore[misc]

    def get_hf_processor(self, **kwargs: object) -> Any:
        if has_torchvision():
            return super().get_hf_processor(**kwargs)  # type: ignore[misc]
        ctx = self.ctx  # type: ignore[attr-defined]
        merged = ctx.get_merged_mm_kwargs(kwargs)
        options = tuple(sorted((k, v) for k, v in merged.items() if k in IMAGE_PROCESSOR_KWARGS))
        key = (ctx.model_config.model, options)
        if key not in self._processors:  # vLLM asks for it per request: build it once, as its own cache does
            self._processors[key] = type(self).load_processor(key[0], tokenizer=ctx.tokenizer, **dict(options))
        return self._processors[key]
