"""A Qwen-Omni transformers processor, built where torchvision cannot be imported.

transformers' Omni processors hold a video processor, and every video processor of transformers
is torchvision's; the torchvision wheels installable beside a CPU build of torch fail at import
(they are built against the CUDA torch). Text, audio and images need none of it: audio is
Whisper's feature extractor (numpy) and images have transformers' PIL backend of the same Qwen2-VL
processing. So where torchvision is missing the processor is built from those, with a video
processor that refuses video by name, and everything else is what transformers does. Where
torchvision imports, transformers' own ``from_pretrained`` runs unchanged (video included).
Each family names its processor class and its refusal (``qwen2_5_omni.processor``, ...).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def video_unsupported(model: str) -> str:
    """Why ``model`` refuses video here (what a request with a video is told)."""
    return (f"video input to {model} needs torchvision (transformers' video processors are "
            "torchvision's), and no torchvision that works with this torch is installed; "
            "text, audio and image inputs work without it")


def has_torchvision() -> bool:
    """Whether ``import torchvision`` would find a package (a broken one fails later, loudly)."""
    return importlib.util.find_spec("torchvision") is not None


def make_video_refusal(merge_size: int, message: str) -> Any:
    """A video processor that refuses every video with ``message``.

    ``merge_size`` is read by the processor for every call, video or not.
    """
    from transformers.video_processing_utils import VideoProcessorMixin

    class VideoInputUnsupported(VideoProcessorMixin):
        """Stands in for Qwen2-VL's video processor, which needs torchvision."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise ValueError(message)

        preprocess = __call__

    refusal = VideoInputUnsupported()
    refusal.merge_size = merge_size
    return refusal


def processor_without_video_class(processor_class: type) -> type:
    """``processor_class`` taking the video refusal (an ``isinstance`` of the real one).

    The base class checks each part's type by the class's name in ``transformers``' namespace,
    where ``VideoProcessorMixin`` is only exported when torchvision is available.
    """

    class ProcessorWithoutVideo(processor_class):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor":
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    ProcessorWithoutVideo.__name__ = ProcessorWithoutVideo.__qualname__ = f"{processor_class.__name__}WithoutVideo"
    return ProcessorWithoutVideo


def load_omni_processor(model_dir: str | Path, processor_class: type, video_message: str, tokenizer: Any = None,
                        **kwargs: Any) -> Any:
    """``processor_class`` of ``model_dir``: transformers' own where torchvision imports, else the
    same processor with PIL image processing and video refused with ``video_message``."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor

    if has_torchvision():
        return processor_class.from_pretrained(str(model_dir), tokenizer=tokenizer, **kwargs)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model_dir = str(model_dir)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir, **kwargs)
    return processor_without_video_class(processor_class)(
        image_processor=image_processor,
        video_processor=make_video_refusal(image_processor.merge_size, video_message),
        feature_extractor=WhisperFeatureExtractor.from_pretrained(model_dir),
        tokenizer=tokenizer,
        chat_template=getattr(tokenizer, "chat_template", None),
    )
