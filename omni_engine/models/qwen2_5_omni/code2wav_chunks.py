"""Which codes each streamed piece of Qwen2.5-Omni's speech is rendered from (``async_chunk``).

token2wav's DiT attends block-wise (``dit_config.block_size`` mel frames, ``repeats`` frames per
code: 24 and 2 in the published checkpoint, so 12 codes a block): each block sees itself and, in a
few layers, one block before or after. So a piece of speech can be rendered from a window of codes
around it, as Qwen's own streaming token2wav does (``past`` blocks before, ``future`` after), and
its audio kept from the middle of the window, where the window's edges do not reach.

Every piece is self-contained: its prompt names the window (``codes`` from ``offset``) and which
of those codes it speaks for (``emit``), so pieces of one request render in any process and pieces
of many requests batch together (interior windows are all the same length). The DiT's starting
noise of a frame is the same in every window that holds it (``code2wav.window_noise``), so
overlapping windows agree where they overlap as far as their context allows.

Geometry in blocks (the published checkpoint's streaming defaults, Qwen's ``bs_mel`` 24, past 2,
future 1, a chunk of 3), with a first piece of one block so the first audio waits for two blocks of
codes, not four.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_engine.stage_output import SPOKEN_SECONDS


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    codes_per_block: int = 12
    first_blocks: int = 1
    chunk_blocks: int = 3
    past_blocks: int = 2
    future_blocks: int = 1
    # Seconds of speech a code gives (2 mel frames of 240 samples at 24 kHz, the published and the
    # tiny checkpoint's token2wav): a piece's stated length, which orders it by its listener's need.
    seconds_per_code: float = 0.02

    def emit_end(self, index: int) -> int:
        """Where piece ``index``'s own codes end (before the end of the request)."""
        return self.codes_per_block * (self.first_blocks + index * self.chunk_blocks)

    @property
    def future(self) -> int:
        return self.codes_per_block * self.future_blocks

    @property
    def past(self) -> int:
        return self.codes_per_block * self.past_blocks

    def ready(self, index: int, known: int) -> bool:
        """Piece ``index`` can be rendered once its codes and its look-ahead are known."""
        return known >= self.emit_end(index) + self.future

    def window(self, start: int, end: int, known: int) -> tuple[int, int]:
        """The codes ``[start, end)`` are rendered from: ``past`` before, ``future`` after."""
        return max(start - self.past, 0), min(end + self.future, known)


def piece_prompt(codes: np.ndarray, voice: Any, start: int, end: int, plan: ChunkPlan) -> dict[str, Any]:
    """code2wav's prompt for the audio of codes ``[start, end)`` out of the ``codes`` known."""
    lo, hi = plan.window(start, end, len(codes))
    return {"codes": np.ascontiguousarray(codes[lo:hi]), "voice": voice, "offset": lo, "emit": [start, end],
            SPOKEN_SECONDS: (end - start) * plan.seconds_per_code}


class CodeStream:
    """A talker request's codes as they come, cut into code2wav's pieces (one per ``ChunkPlan`` chunk,
    then the rest when the talker has finished)."""

    def __init__(self, plan: ChunkPlan | None = None) -> None:
        self.plan = plan or ChunkPlan()
        self.codes = np.zeros(0, np.int64)
        self.voice: Any = None
        self.pieces = 0  # pieces sent
        self.sent_to = 0  # codes spoken for by the pieces sent

    def add(self, codes: Any, offset: int, voice: Any) -> list[dict[str, Any]]:
        """Codes ``codes`` from position ``offset`` (a talker's partial output); the pieces now ready."""
        codes = np.asarray(codes, np.int64).reshape(-1)
        have = len(self.codes)
        if offset > have:
            raise ValueError(f"talker codes from position {offset} arrived with only {have} known")
        if offset + len(codes) > have:
            self.codes = np.concatenate([self.codes, codes[have - offset:]])
        self.voice = voice if voice is not None else self.voice
        out = []
        while self.plan.ready(self.pieces, len(self.codes)):
            end = self.plan.emit_end(self.pieces)
            out.append(piece_prompt(self.codes, self.voice, self.sent_to, end, self.plan))
            self.pieces, self.sent_to = self.pieces + 1, end
        return out

    def finish(self, codes: Any, voice: Any) -> list[dict[str, Any]]:
        """The talker's final codes (all of them): one last piece for what is not spoken for yet."""
        self.codes = np.asarray(codes, np.int64).reshape(-1)
        self.voice = voice if voice is not None else self.voice
        if self.sent_to >= len(self.codes) and self.pieces:
            return []
        piece = piece_prompt(self.codes, self.voice, self.sent_to, len(self.codes), self.plan)
        self.pieces, self.sent_to = self.pieces + 1, len(self.codes)
        return [piece]
