"""Playback deadlines: when a piece of output is needed, and serving the earliest first.

A listener hears speech at 1x from its first chunk on, so each later piece of audio is needed
when the audio before it has played out; the first is needed now. A request carries that moment
(``deadline``, wall-clock ``time.time()`` seconds, the one clock every process of a host shares)
to every stage that works for it, and a stage with a queue serves the earliest deadline first
(EDF) instead of first come, first served: a listener whose buffer is about to run dry goes
before a sentence whose listener has ten seconds of audio queued, and a new session's first words
go before everyone's later sentences. A request without a deadline is due ``NO_DEADLINE_SLACK_S``
after it arrived, so batch work still moves under a steady stream of speech. Nothing is dropped:
a piece whose deadline has passed is still made, and counted (``DeadlineStats``).

No vLLM here: generation stages import this module.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

# A request without a deadline is due this long after it arrived: it yields to speech needed
# sooner, and overtakes speech needed later.
NO_DEADLINE_SLACK_S = 2.0

# Spoken English at speed 1.0, characters of text per second of speech (punctuation and spaces
# included). Measured here on bench_speech_load.py's 4-sentence passage (315 characters): Piper's
# joe voice 19.8 (15.9 s), eSpeak NG 21.1 (14.9 s); the lower one errs towards earlier deadlines.
# It only orders pieces before their audio exists.
CHARS_PER_SECOND = 19.8

T = TypeVar("T")


def effective_deadline(deadline: float | None, arrival: float | None = None) -> float:
    """``deadline``, or ``arrival`` (default: now) plus the slack of a request without one."""
    if deadline is not None:
        return deadline
    return (arrival if arrival is not None else time.time()) + NO_DEADLINE_SLACK_S


def estimate_speech_seconds(text: str, speed: float = 1.0) -> float:
    """Roughly how long ``text`` takes to say at ``speed`` (before it is synthesized)."""
    return len(text.strip()) / CHARS_PER_SECOND / (speed if speed > 0 else 1.0)


class EdfQueue(Generic[T]):
    """Items by deadline, earliest first; equal deadlines keep their arrival order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._order = itertools.count()

    def push(self, item: T, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), item))

    def pop(self) -> tuple[T, float]:
        """The earliest item and its deadline (IndexError when empty)."""
        deadline, _, item = heapq.heappop(self._heap)
        return item, deadline

    def pop_batch(self, limit: int, key: Callable[[T], Hashable] | None = None,
                  live: Callable[[T], bool] | None = None) -> list[tuple[T, float]]:
        """Up to ``limit`` items and their deadlines, earliest first: the earliest ``live`` one and
        then only those whose ``key`` equals its own. The others keep their places (and their order
        among equal deadlines); items that are not ``live`` are dropped."""
        batch: list[tuple[T, float]] = []
        passed: list[tuple[float, int, T]] = []
        first: Hashable = None
        while self._heap and len(batch) < limit:
            entry = heapq.heappop(self._heap)
            deadline, _, item = entry
            if live is not None and not live(item):
                continue
            if key is not None:
                this = key(item)
                if batch and this != first:
                    passed.append(entry)
                    continue
                first = this
            batch.append((item, deadline))
        for entry in passed:
            heapq.heappush(self._heap, entry)
        return batch

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)


# The Prometheus families of ``DeadlineStats`` (counters without their ``_total``, as
# prometheus_client names a counter family).
DEADLINE_SERVED = "omni_engine_stage_deadline_served"
DEADLINE_LATE = "omni_engine_stage_deadline_late"
DEADLINE_MAX_LATENESS = "omni_engine_stage_deadline_max_lateness_seconds"


class DeadlineStats:
    """What a stage served and how late: for tests (the order) and operators (late pieces)."""

    RECENT = 256

    def __init__(self) -> None:
        self.served = 0
        self.late = 0
        self.max_lateness_s = 0.0
        # (request id, deadline) in the order their work began, the last RECENT of them.
        self.recent: deque[tuple[str, float]] = deque(maxlen=self.RECENT)

    def started(self, request_id: str, deadline: float) -> None:
        self.recent.append((request_id, deadline))

    def finished(self, deadline: float, now: float) -> None:
        """A piece is done (its output exists at ``now``): late if that is after its deadline."""
        self.served += 1
        if now > deadline:
            self.late += 1
            self.max_lateness_s = max(self.max_lateness_s, now - deadline)

    def snapshot(self) -> dict[str, Any]:
        return {"served": self.served, "late": self.late, "max_lateness_s": round(self.max_lateness_s, 4),
                "recent": [list(entry) for entry in self.recent]}

    def families(self) -> list[list[Any]]:
        """The same figures as Prometheus families (``prometheus_snapshot``'s plain-list format, so
        a generation stage needs no prometheus_client): the server's ``/metrics`` shows them per
        stage replica, an operator's view of whether speech keeps up with its listeners."""
        return [
            [DEADLINE_SERVED, "counter", "Per stage replica: pieces (requests) served with a deadline",
             [[DEADLINE_SERVED + "_total", {}, float(self.served)]]],
            [DEADLINE_LATE, "counter", ("Per stage replica: pieces done after their deadline (made anyway); "
                                        "a piece due the moment it was asked for, such as a stream's first, always is"),
             [[DEADLINE_LATE + "_total", {}, float(self.late)]]],
            [DEADLINE_MAX_LATENESS, "gauge", "Per stage replica: the most seconds a piece was done after its deadline",
             [[DEADLINE_MAX_LATENESS, {}, float(self.max_lateness_s)]]],
        ]
