"""Qwen2.5-Omni's transformers processor, built where torchvision cannot be imported
(``omni_engine.models.omni_processor``: video refused by name, the rest as transformers does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_engine.models.omni_processor import has_torchvision, load_omni_processor, video_unsupported

__all__ = ["VIDEO_UNSUPPORTED", "has_torchvision", "load_processor"]

VIDEO_UNSUPPORTED = video_unsupported("Qwen2.5-Omni")


def load_processor(model_dir: str | Path, tokenizer: Any = None, **kwargs: Any) -> Any:
    """``Qwen2_5OmniProcessor`` of ``model_dir`` (video refused where torchvision is missing)."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
        Qwen2_5OmniProcessor,
    )

    return load_omni_processor(model_dir, Qwen2_5OmniProcessor, VIDEO_UNSUPPORTED, tokenizer=tokenizer, **kwargs)
