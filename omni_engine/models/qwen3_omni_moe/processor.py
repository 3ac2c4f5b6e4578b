"""Qwen3-Omni's transformers processor, built where torchvision cannot be imported
(``omni_engine.models.omni_processor``: video refused by name, the rest as transformers does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_engine.models.omni_processor import load_omni_processor, video_unsupported

VIDEO_UNSUPPORTED = video_unsupported("Qwen3-Omni")


def load_processor(model_dir: str | Path, tokenizer: Any = None, **kwargs: Any) -> Any:
    """``Qwen3OmniMoeProcessor`` of ``model_dir`` (video refused where torchvision is missing)."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        Qwen3OmniMoeProcessor,
    )

    return load_omni_processor(model_dir, Qwen3OmniMoeProcessor, VIDEO_UNSUPPORTED, tokenizer=tokenizer, **kwargs)
