"""``PlaybackClock``: when each piece of one request's speech will be needed by its listener.

A request whose final stage speaks is cut into pieces on its way (the LLM's sentences, each
phonemized and voiced as sub-request k of its stage). The listener plays at 1x from the first
audio on, so piece k is needed when pieces 0..k-1 have played: at the first audio's arrival plus
their durations, or before any audio, at the request's start plus their estimated durations
(from their text, ``deadlines.estimate_speech_seconds``, or as a codec piece states it). Each
estimate gives way to the real duration as that piece's audio reaches the caller. The orchestrator stamps every sub-request
with its piece's deadline, and every stage on the way serves earliest first.
"""

from __future__ import annotations

from typing import Any

from omni_engine.deadlines import estimate_speech_seconds
from omni_engine.stage_output import SPOKEN_SECONDS, SPOKEN_TEXT


class PlaybackClock:
    """Deadlines of one request's pieces of speech (piece k = sub-request k of a stage)."""

    __slots__ = ("start", "speed", "first_audio_at", "_seconds", "_arrived")

    def __init__(self, start: float, speed: float = 1.0) -> None:
        """``start``: when the first piece is needed (the caller's deadline, else its arrival)."""
        self.start = start
        self.speed = speed
        self.first_audio_at: float | None = None
        self._seconds: dict[int, float] = {}  # piece -> its duration: estimated, then heard
        self._arrived: dict[int, float] = {}  # piece -> when its first audio reached the caller

    def note_input(self, k: int, prompt: Any) -> None:
        """Piece ``k`` is submitted with ``prompt``: its length as the prompt states it
        (``SPOKEN_SECONDS``), else estimated from its text, if it has any and no stage before gave one."""
        if k in self._seconds:
            return
        seconds = prompt.get(SPOKEN_SECONDS) if isinstance(prompt, dict) else None
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds >= 0:
            self._seconds[k] = float(seconds)  # a codec piece's own length: no speed, no estimate
            return
        text = prompt if isinstance(prompt, str) else prompt.get(SPOKEN_TEXT) if isinstance(prompt, dict) else None
        if isinstance(text, str):
            self._seconds[k] = estimate_speech_seconds(text, self.speed)

    def heard(self, k: int, seconds: float, now: float) -> None:
        """``seconds`` of piece ``k``'s audio reached the caller (in order) at ``now``."""
        if self.first_audio_at is None:
            self.first_audio_at = now
        if k not in self._arrived:
            self._arrived[k] = now
            self._seconds[k] = 0.0
        self._seconds[k] += seconds

    def arrived_at(self, k: int) -> float | None:
        """When piece ``k``'s first audio reached the caller (None: not yet)."""
        return self._arrived.get(k)

    def heard_seconds(self, k: int) -> float:
        """Seconds of piece ``k``'s audio that have reached the caller."""
        return self._seconds.get(k, 0.0) if k in self._arrived else 0.0

    def deadline(self, k: int) -> float:
        """When piece ``k``'s audio must reach the caller for the listener not to run dry."""
        base = self.first_audio_at if self.first_audio_at is not None else self.start
        seconds = self._seconds
        return base + sum(seconds.get(j, 0.0) for j in range(k))


def speed_of(params: Any) -> float:
    """The speech speed in a speech stage's params (a dict or ``SpeechParams``), 1.0 when unset."""
    speed = params.get("speed") if isinstance(params, dict) else getattr(params, "speed", None)
    try:
        return float(speed) if speed else 1.0
    except (TypeError, ValueError):
        return 1.0
