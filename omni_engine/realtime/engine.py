"""What a realtime session needs of the pipeline, as one small protocol.

The session code (``session.py``, ``response.py``) holds only per-session state and speaks to
the pipeline through this interface, so it has no idea of stage ids, vLLM's chat rendering or
HTTP; ``omni_engine.entrypoints.openai.realtime`` implements it over ``MultiStageEngineClient``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, NamedTuple, Protocol

import numpy as np


class ResponseStart(NamedTuple):
    """First thing a response yields: the prompt's length in tokens (for usage)."""

    prompt_tokens: int


class TextDelta(NamedTuple):
    text: str
    tokens: int
    finish_reason: str | None


class AudioChunk(NamedTuple):
    """One spoken piece of the answer (float32 mono) at the speech stage's ``rate``: a sentence, or
    the first fragment of one; ``text`` is what it says, where the speech stage reports it."""

    samples: np.ndarray
    rate: int
    text: str | None = None


class FunctionCallDelta(NamedTuple):
    """A piece of the ``index``-th function call of the answer: its first piece has the id and name."""

    index: int
    call_id: str | None
    name: str | None
    arguments: str


ResponsePiece = ResponseStart | TextDelta | AudioChunk | FunctionCallDelta


class Turn(Protocol):
    """A turn's trace (``omni_engine.tracing.turn_trace.TurnTrace``): the moments it records, and the
    trace context (``headers``) the pipeline requests made for the turn run under."""

    headers: dict[str, str]

    def event(self, name: str) -> None: ...

    def set(self, key: str, value: Any) -> None: ...

    def end(self, status: str) -> None: ...


class RealtimeEngine(Protocol):
    can_hear: bool   # the pipeline has a speech-to-text stage
    can_speak: bool  # the pipeline has a speech stage
    # The LLM hears audio itself (Qwen-Omni's thinker): a user's audio reaches it as an input_audio
    # part of its chat, not as a transcript.
    hears_audio: bool
    default_voice: str | None  # the speech stage's own default, where OpenAI's names are not its voices
    can_call_tools: bool  # the server parses the LLM's tool calls (--enable-auto-tool-choice)

    def start_turn(self, item_id: str | None) -> Turn | None:
        """A new turn's trace, or None where the pipeline is not traced."""

    def check_voice(self, voice: str, speed: float) -> None:
        """``SessionConfigError`` if the speech stage does not take ``voice``/``speed``."""

    def check_language(self, language: str | None) -> None:
        """``SessionConfigError`` if the speech-to-text stage does not know ``language``."""

    async def transcribe(self, audio: np.ndarray, *, language: str | None, prompt: str | None,
                         request_id: str) -> str:
        """The text of ``audio`` (16 kHz float32 mono)."""

    def respond(self, messages: list[dict[str, Any]], *, audio: bool, voice: str, speed: float,
                max_tokens: int | None, temperature: float | None, tools: list[dict[str, Any]],
                tool_choice: str | dict[str, Any], request_id: str) -> AsyncGenerator[ResponsePiece, None]:
        """The LLM's answer to ``messages`` (chat messages) as it is written, and (``audio``) spoken
        sentence by sentence; with ``tools`` (Chat Completions' shape), its calls as ``FunctionCallDelta``s.
        Closing the generator early aborts the request on every stage."""
