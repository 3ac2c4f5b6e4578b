"""Finding a model that blocks the event loop it shares with the client.

A stage on the client's event loop (``runtime.event_loop: client``) shares that
loop with the orchestrator, every stage's client and the HTTP server: a model
whose ``generate`` computes without awaiting holds all of them, and nothing
else would say which stage did. So each step of the model's coroutine is timed
(two clock reads a step, in the model's task only) and a step that held the
loop past a limit is reported, naming the stage and what to do about it.
Garbage collection that ran during a step is not the model's doing (and with
vLLM and torch loaded a full collection can take that long): it is left out.
"""

from __future__ import annotations

import gc
import logging
import time
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A step longer than this is a hold worth a warning: every other request of the
# process waited that long (a speech model's steps here take microseconds).
HOLD_LIMIT_S = 0.1
# After a warning, the next comes no sooner than this, with a count of what came between.
WARN_EVERY_S = 60.0


class _GcClock:
    """Seconds this process has spent collecting garbage since it was installed (gc.callbacks)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.total_s += time.perf_counter() - self._started
            self._started = None

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)


_GC_CLOCK = _GcClock()


class LoopHoldReport:
    """Counts a stage's model steps that held the loop, and warns (rate-limited) about them."""

    def __init__(self, stage_id: int, limit_s: float = HOLD_LIMIT_S, warn_every_s: float = WARN_EVERY_S) -> None:
        self.stage_id = stage_id
        self.limit_s = limit_s
        self.warn_every_s = warn_every_s
        self.holds = 0  # steps over the limit, all told
        self.longest_s = 0.0
        self._unreported = 0
        self._warned_at: float | None = None

    def __call__(self, held_s: float) -> None:
        self.holds += 1
        self._unreported += 1
        self.longest_s = max(self.longest_s, held_s)
        now = time.monotonic()
        if self._warned_at is not None and now - self._warned_at < self.warn_every_s:
            return
        logger.warning(
            "stage %d: its model held the client's event loop for %.3f s in one step (%d step(s) over %.3f s "
            "since the last warning); every request and connection of this process waited meanwhile. Make the "
            "model's generate await its work (e.g. asyncio.to_thread), or run the stage with "
            "runtime.event_loop: own", self.stage_id, held_s, self._unreported, self.limit_s)
        self._warned_at = now
        self._unreported = 0


async def timed_steps(coro: Coroutine[Any, Any, T], limit_s: float, report: Callable[[float], None]) -> T:
    """Await ``coro``, calling ``report(seconds)`` for each of its steps that ran longer than ``limit_s``
    (garbage collection during the step not counted)."""
    _GC_CLOCK.install()
    return await _steps(coro, limit_s, report)


@types.coroutine
def _steps(coro: Coroutine[Any, Any, T], limit_s: float,
           report: Callable[[float], None]) -> Generator[Any, Any, T]:
    # Drives ``coro`` the way its task would, passing through what it yields (the futures it
    # waits on) and what the task sends or throws in (results, cancellation).
    value: Any = None
    error: BaseException | None = None
    while True:
        started, collecting = time.perf_counter(), _GC_CLOCK.total_s
        try:
            yielded = coro.send(value) if error is None else coro.throw(error)
        except StopIteration as done:
            return done.value
        finally:
            held = time.perf_counter() - started - (_GC_CLOCK.total_s - collecting)
            if held > limit_s:
                report(held)
        try:
            value, error = (yield yielded), None
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the model's coroutine, as its task would
            value, error = None, exc
