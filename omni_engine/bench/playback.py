"""A listener that plays a stream at 1x from its first chunk: what "real time" means to a person.

A chunk of ``d`` seconds of audio arriving at ``t`` (seconds after the request was sent) is queued
behind what the listener has not heard yet. Playing starts when the first chunk arrives; an
underrun is each time the queue runs dry before the next chunk arrives (the listener hears
silence for ``arrival - dry``) while the stream has not ended.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Playback:
    """What the listener of one stream experienced."""

    first_audio_s: float | None  # request sent -> first chunk (None: no audio came)
    audio_s: float  # seconds of audio received
    underruns: int
    underrun_s: float  # silence heard mid-stream, in total
    played_until_s: float  # when the last sample was heard (request-relative)


def play(chunks: Iterable[tuple[float, float]]) -> Playback:
    """``chunks``: (arrival time, audio seconds) in arrival order, times relative to the request."""
    first: float | None = None
    dry_at = 0.0  # when the queued audio runs out
    audio = silence = 0.0
    underruns = 0
    for arrival, seconds in chunks:
        if seconds <= 0:
            continue
        if first is None:
            first, dry_at = arrival, arrival
        elif arrival > dry_at:
            underruns += 1
            silence += arrival - dry_at
            dry_at = arrival
        dry_at += seconds
        audio += seconds
    return Playback(first, audio, underruns, silence, dry_at if first is not None else 0.0)
