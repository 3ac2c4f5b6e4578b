"""A session's input audio buffer at 16 kHz, with server VAD over it.

Appended audio is resampled to 16 kHz as it arrives (the rate of the VAD and of Whisper) and
kept until it is committed. Offsets are absolute: samples since the session began, so they are
also OpenAI's ``audio_start_ms`` / ``audio_end_ms`` (÷ 16). With server VAD, while nobody
speaks only the last ``prefix_padding_ms`` are kept: the buffer does not grow with silence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from omni_engine.realtime.audio_io import StreamResampler, rate_of
from omni_engine.realtime.config import TurnDetection

RATE = 16000
# Whisper stage's own limit on one audio input (engines/transcription.py): one hour.
MAX_BUFFER_S = 3600


class InputAudio:
    """Buffered 16 kHz input; ``append`` returns the VAD's speech events with absolute offsets."""

    def __init__(self, fmt: str, turn: TurnDetection | None, vad_factory: Callable[[Any], Any] | None) -> None:
        self.total = 0          # 16 kHz samples appended since the session began
        self._chunks: list[np.ndarray] = []
        self._start = 0         # absolute offset of the first buffered sample
        self._vad_factory = vad_factory
        self.configure(fmt, turn)

    def configure(self, fmt: str, turn: TurnDetection | None) -> None:
        """New format or turn detection: the resampler and the VAD start over (the buffer stays)."""
        self.fmt, self.turn = fmt, turn
        self._resampler = StreamResampler(rate_of(fmt), RATE)
        self.vad = None
        if turn is not None and self._vad_factory is not None:
            self.vad = self._vad_factory(turn)
        self._vad_origin = self.total

    @property
    def buffered(self) -> int:
        """Samples held: the chunks cover exactly ``[_start, total)`` (no sum over them on every append)."""
        return self.total - self._start

    def append(self, samples: np.ndarray) -> list[tuple[str, int]]:
        """Add audio at the format's rate; the VAD's ``(kind, absolute sample)`` events it caused."""
        chunk = self._resampler.feed(samples)
        if self.buffered + len(chunk) > MAX_BUFFER_S * RATE:
            raise OverflowError(f"the input audio buffer holds {MAX_BUFFER_S} s at most; commit or clear it")
        self._chunks.append(chunk)
        self.total += len(chunk)
        if self.vad is None:
            return []
        events = [(str(getattr(e.kind, "value", e.kind)), e.sample + self._vad_origin) for e in self.vad.feed(chunk)]
        if not self.vad.speaking and not events:
            self._keep_last(int(self.turn.prefix_padding_ms * RATE / 1000) + 512)
        return events

    def pause_start(self) -> int | None:
        """Absolute offset where the speaker's current pause began (VAD on, mid-turn), else None."""
        pause = self.vad.pause_start if self.vad is not None else None
        return None if pause is None else pause + self._vad_origin

    def silence_samples(self) -> int:
        """The silence that ends a turn, in samples (the VAD's stop lands this far after the pause began)."""
        return self.turn.silence_duration_ms * RATE // 1000 if self.turn is not None else 0

    def peek(self, start: int, end: int) -> np.ndarray:
        """The buffered audio in ``[start, end)`` (absolute), leaving the buffer as it is."""
        audio = np.concatenate(self._chunks) if self._chunks else np.zeros(0, dtype=np.float32)
        start, end = max(start, self._start), min(end, self.total)
        return audio[start - self._start:max(start, end) - self._start]

    def take(self, start: int | None = None, end: int | None = None) -> np.ndarray:
        """The buffered audio in ``[start, end)`` (absolute; default all); everything before ``end`` leaves the buffer."""
        audio = np.concatenate(self._chunks) if self._chunks else np.zeros(0, dtype=np.float32)
        end = self.total if end is None else min(end, self.total)
        start = self._start if start is None else max(start, self._start)
        taken = audio[start - self._start:max(start, end) - self._start]
        rest = audio[end - self._start:]
        self._chunks = [rest] if len(rest) else []
        self._start = end
        return taken

    def clear(self) -> None:
        self._chunks, self._start = [], self.total
        if self.vad is not None and self.vad.speaking:
            self.configure(self.fmt, self.turn)

    def _keep_last(self, n: int) -> None:
        if self.buffered > 2 * n:
            self.take(end=self.total - n)
