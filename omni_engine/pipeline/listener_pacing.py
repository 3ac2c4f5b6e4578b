"""``ListenerPacer``: when a stream's next piece of speech must leave early, so its listener never waits.

An edge that cuts a talker's frames into code2wav pieces sends each piece when it has its planned
size. A plan holds only for a talker fast enough to make each next piece while the audio before it
plays (the ramped Qwen3 plan: 2x real time); under load the talker is slower and the listener hears
silence. The pacer watches the request's ``PlaybackClock`` instead of assuming a speed:

- the listener runs dry at its first audio plus the audio of every piece sent so far (each piece's
  frames at the seconds per frame the pieces heard so far have shown);
- a piece sent now reaches the caller after the latency the stream's pieces show (sent -> heard:
  the latest one heard, or the oldest still unheard if it is already waiting longer);
- the edge's next chance to send is one talker output away (the gap since the last one).

When waiting for that next output would land the piece after the listener runs dry, the frames
made so far leave now, as a short piece. Short pieces cost code2wav more (each sees its left
context again), so the pacer sends early only when the plan would leave a gap, never otherwise;
before the first audio it does nothing (the plan's first piece is already small).
"""

from __future__ import annotations

import time

from omni_engine.pipeline.playback_clock import PlaybackClock


class ListenerPacer:
    """One stream's pieces as sent (piece k = sub-request k of the speaking stage), against its clock."""

    __slots__ = ("clock", "_frames", "_sent_at", "_heard", "_heard_frames", "_heard_s", "_latency", "_last", "_total")

    def __init__(self, clock: PlaybackClock) -> None:
        self.clock = clock
        self._frames: list[int] = []  # per piece sent
        self._sent_at: list[float] = []
        self._heard = 0  # pieces 0.._heard-1 have reached the caller
        self._heard_frames = 0
        self._heard_s = 0.0
        self._latency = 0.0  # sent -> heard, of the latest piece heard
        self._last: float | None = None  # the last talker output seen
        self._total = 0  # frames sent

    def sent(self, frames: int, now: float | None = None) -> None:
        """A piece of ``frames`` frames left for the speaking stage."""
        self._frames.append(frames)
        self._total += frames
        self._sent_at.append(time.time() if now is None else now)

    def due(self, now: float | None = None) -> bool:
        """Whether the frames made so far must leave now (asked once per talker output)."""
        now = time.time() if now is None else now
        step, self._last = (now - self._last if self._last is not None else 0.0), now
        clock = self.clock
        if clock.first_audio_at is None:
            return False
        while self._heard < len(self._frames) and (arrived := clock.arrived_at(self._heard)) is not None:
            self._heard_frames += self._frames[self._heard]
            self._heard_s += clock.heard_seconds(self._heard)
            self._latency = arrived - self._sent_at[self._heard]
            self._heard += 1
        if not self._heard_frames:
            return False
        latency = self._latency
        if self._heard < len(self._frames):  # a piece still on its way: it has waited this long already
            latency = max(latency, now - self._sent_at[self._heard])
        dry_at = clock.first_audio_at + self._total * self._heard_s / self._heard_frames
        return now + latency + step >= dry_at
