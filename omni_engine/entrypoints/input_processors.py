"""Earlier import path of the input processors (``custom_process_input_func``
values written as ``omni_engine.entrypoints.input_processors:sentences`` keep working)."""

from omni_engine.pipeline.input_processors import (  # noqa: F401
    InputProcessor,
    SentenceSplitter,
    StageInput,
    TextPassthrough,
    sentences,
    text,
)

__all__ = ["InputProcessor", "SentenceSplitter", "StageInput", "TextPassthrough", "sentences", "text"]
