"""Qwen3-Omni's codec chunking: which frames of a stream go to code2wav when (vLLM-Omni's plan).

A stream's first piece is its first ``initial`` frames (first audio after 4 frames, 320 ms); each
later piece is the next ``size`` frames with up to ``left_context`` frames before them for the
decoder to see (their audio is cut: ``code2wav``); at the end, what is left. vLLM-Omni's Qwen3-Omni
deploy config sets 4, 25 and 25 (its ``connectors:`` block: ``initial_codec_chunk_frames``,
``codec_chunk_frames``, ``codec_left_context_frames``).

``ramp`` (``codec_chunk_ramp``, on by default): a later piece is at most as many frames as were sent
before it (4, 4, 8, 16, then 25s), so with a talker at 2x real time or more a piece is made while the
audio before it plays, and the listener never waits. Without it, the second piece (25 frames, 2 s)
must be made within the first one's 320 ms: a talker at 6x real time; measured on 2 cores, 8 streams
at once, made at 2.5x real time, all underran (6 of 8 at 4 at once).

A stream with a ``ListenerPacer`` (``codec_chunk_pacing``, on by default when served) also lets the
frames made so far go as a short piece whenever waiting for the planned size would make its
listener wait (a talker below 2x real time under load): the plan is the most a piece waits for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_engine.pipeline.listener_pacing import ListenerPacer


@dataclass(frozen=True, slots=True)
class CodecChunks:
    initial: int = 4
    size: int = 25
    left_context: int = 25
    ramp: bool = True

    def __post_init__(self) -> None:
        if self.initial < 1 or self.size < 1 or self.left_context < 0:
            raise ValueError(f"codec chunks: initial {self.initial} and size {self.size} must be >= 1, "
                             f"left_context {self.left_context} >= 0")

    def next_end(self, sent: int) -> int:
        """Where the piece after the first ``sent`` frames ends, as planned (frames)."""
        if not sent:
            return self.initial
        return sent + (min(self.size, sent) if self.ramp else self.size)


class CodecStream:
    """One request's frames as they come; pieces (code2wav prompts) as soon as each is whole."""

    def __init__(self, chunks: CodecChunks | None = None, pacer: ListenerPacer | None = None) -> None:
        self.chunks = chunks or CodecChunks()
        self.pacer = pacer
        self.frames: np.ndarray | None = None  # [G, known]
        self.sent = 0  # frames whose audio has been asked for

    def add(self, codes: Any, offset: int, now: float | None = None) -> list[dict[str, Any]]:
        """Frames ``codes`` ``[G, n]`` from frame ``offset`` on (at ``now``, the pacer's time); the
        pieces now whole, or due (``ListenerPacer``)."""
        codes = np.asarray(codes, dtype=np.int64)
        if self.frames is None:
            self.frames = np.zeros((codes.shape[0], 0), dtype=np.int64)
        known = self.frames.shape[1]
        if offset + codes.shape[1] > known:
            self.frames = np.concatenate([self.frames[:, :offset], codes], axis=1)
        out, known = [], self.frames.shape[1]
        while known >= self.chunks.next_end(self.sent):
            out.append(self.piece(self.chunks.next_end(self.sent), now))
        # An early piece is at least the first piece's size: a talker slower than real time (the
        # listener waits whatever is sent) must not turn into code2wav decoding each frame alone.
        if self.pacer is not None and self.pacer.due(now) and known - self.sent >= self.chunks.initial:
            out.append(self.piece(known, now))
        return out

    def finish(self, codes: Any, now: float | None = None) -> list[dict[str, Any]]:
        """The final output's frames (all of them): the pieces not sent yet, the last one short."""
        codes = np.asarray(codes, dtype=np.int64)
        self.frames = codes
        out = self.add(codes[:, :0], codes.shape[1], now)
        if self.sent < codes.shape[1]:
            out.append(self.piece(codes.shape[1], now))
        return out

    def piece(self, end: int, now: float | None = None) -> dict[str, Any]:
        start = self.sent
        low = max(0, start - self.chunks.left_context)
        self.sent = end
        if self.pacer is not None:
            self.pacer.sent(end - start, now)
        return {"codes": np.ascontiguousarray(self.frames[:, low:end]), "left_context": start - low}
