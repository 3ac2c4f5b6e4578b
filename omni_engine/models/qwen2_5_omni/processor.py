"""Qwen2.5-Omni's transformers processor, built where torchvision cannot be imported.

transformers' Qwen2.5-Omni processor holds a video processor, and every video processor of
transformers is torchvision's; the torchvision wheels installable beside a CPU build of torch
fail at import (they are built against the CUDA torch). Text, audio and images need none of it:
audio is Whisper's feature extractor (numpy) and images have transformers' PIL backend of the
same Qwen2-VL processing. So where torchvision is missing the processor is built from those, with
a video processor that refuses video by name, and everything else is what transformers does.
Where torchvision imports, transformers' own ``from_pretrained`` runs unchanged (video included).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

VIDEO_UNSUPPORTED = (
    "video input to Qwen2.5-Omni needs torchvision (transformers' video processors are "
    "torchvision's), and no torchvision that works with this torch is installed; "
    "text, audio and image inputs work without it")


def has_torchvision() -> bool:
    """Whether ``import torchvision`` would find a package (a broken one fails later, loudly)."""
    return importlib.util.find_spec("torchvision") is not None


def make_video_refusal(merge_size: int) -> Any:
    """A video processor that refuses every video with ``VIDEO_UNSUPPORTED``.

    ``merge_size`` is read by the processor for every call, video or not.
    """
    from transformers.video_processing_utils import VideoProcessorMixin

    class VideoInputUnsupported(VideoProcessorMixin):
        """Stands in for Qwen2-VL's video processor, which needs torchvision."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise ValueError(VIDEO_UNSUPPORTED)

        preprocess = __call__

    refusal = VideoInputUnsupported()
    refusal.merge_size = merge_size
    return refusal


def processor_without_video_class() -> type:
    """``Qwen2_5OmniProcessor`` that takes the video refusal (an ``isinstance`` of the real one).

    The base class checks each part's type by the class's name in ``transformers``' namespace,
    where ``VideoProcessorMixin`` is only exported when torchvision is available.
    """
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
        Qwen2_5OmniProcessor,
    )

    class Qwen2_5OmniProcessorWithoutVideo(Qwen2_5OmniProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor":
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    return Qwen2_5OmniProcessorWithoutVideo


def load_processor(model_dir: str | Path, tokenizer: Any = None, **kwargs: Any) -> Any:
    """``Qwen2_5OmniProcessor`` of ``model_dir``: transformers' own where torchvision imports,
    else the same processor with PIL image processing and video refused."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
        Qwen2_5OmniProcessor,
    )

    if has_torchvision():
        return Qwen2_5OmniProcessor.from_pretrained(str(model_dir), tokenizer=tokenizer, **kwargs)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model_dir = str(model_dir)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir, **kwargs)
    return processor_without_video_class()(
        image_processor=image_processor,
        video_processor=make_video_refusal(image_processor.merge_size),
        feature_extractor=WhisperFeatureExtractor.from_pretrained(model_dir),
        tokenizer=tokenizer,
        chat_template=getattr(tokenizer, "chat_template", None),
    )
