"""``BaseSampler``: the seed's interface, and the one scheduler every backend shares.

A sampler has *lanes*: slots that each run one request at a time (an HTTP
request, an engine request, a call into one Ray worker). Lanes pull tasks from
one ``WorkQueue`` as they free up, so a slow lane (a slow worker) takes fewer
tasks instead of holding up a static share of them, and the Pipeline can add
an item's next round as soon as its previous one is back (no round barrier).
A backend implements ``sample(task, lane)``; everything else is here.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from omni_engine.sampling.config import SamplerConfig, sampler_problems
from omni_engine.sampling.items import BatchResult, ItemResult, Response, SampleTask, check_item, item_seed

logger = logging.getLogger(__name__)


class SamplerInitError(RuntimeError):
    """``initialize()`` found the config or the backend unusable (the message says which field or what)."""


class SamplerUnavailable(RuntimeError):
    """No lane is left to run the remaining tasks (every Ray worker died)."""


class LaneLost(Exception):
    """Raised by ``sample`` when its lane can take no more work (its worker died):
    the task goes back to the queue for another lane."""


class WorkQueue:
    """Tasks waiting for a lane. The producer may ``put`` more while results come back
    and ``close()``s it when no more will come. Lanes stop once it is closed, empty and
    no task is in flight (a lost lane's task may still come back)."""

    def __init__(self, tasks: Iterable[SampleTask] = (), *, closed: bool = False) -> None:
        self._tasks: collections.deque[SampleTask] = collections.deque(tasks)
        self._closed = closed
        self._in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def __len__(self) -> int:
        return len(self._tasks)

    def put(self, task: SampleTask) -> None:
        if self._closed:
            raise RuntimeError("put on a closed WorkQueue")
        self._tasks.append(task)
        self._wake(1)

    def requeue(self, task: SampleTask) -> None:
        """A task whose lane was lost: first in line for the next free lane."""
        self._tasks.appendleft(task)
        self._wake(1)

    def close(self) -> None:
        self._closed = True
        self._wake(len(self._waiters))

    async def get(self) -> SampleTask | None:
        """The next task (call ``task_done`` after it); None once nothing more can come."""
        while not self._tasks:
            if self._closed and self._in_flight == 0:
                return None
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._in_flight += 1
        return self._tasks.popleft()

    def task_done(self) -> None:
        self._in_flight -= 1
        if self._closed and self._in_flight == 0 and not self._tasks:
            self._wake(len(self._waiters))

    def _wake(self, count: int) -> None:
        while count > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                count -= 1


class BaseSampler(ABC):
    """Generates ``n`` responses per item: ``initialize()``, ``sample_batch()``, ``shutdown()``
    (or ``async with``). Subclasses implement ``sample`` and, if their lanes are not
    ``concurrency`` interchangeable slots, ``lanes``."""

    kind: str = "?"

    def __init__(self, config: SamplerConfig) -> None:
        self.config = config

    # ------------------------------------------------------------ lifecycle
    async def initialize(self) -> None:
        """Check the config against the backend and load what must be loaded; fail early and clearly.
        Subclasses call this first."""
        problems = sampler_problems(self.config)
        if not problems and self.config.kind != self.kind:
            problems = [("sampler.kind", f"{self.config.kind!r} given to the {self.kind} sampler")]
        if problems:
            raise SamplerInitError("; ".join(f"{field}: {problem}" for field, problem in problems))

    async def shutdown(self) -> None:
        """Free what ``initialize`` took. Idempotent."""

    async def __aenter__(self) -> BaseSampler:
        try:
            await self.initialize()
        except BaseException:
            await self.shutdown()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    # ------------------------------------------------------------- backend
    def lanes(self) -> Sequence[Any]:
        """One entry per request that may run at once; each is passed to ``sample``."""
        return range(self.config.concurrency)

    @abstractmethod
    async def sample(self, task: SampleTask, lane: Any) -> list[Response]:
        """``task.n`` responses for ``task.item``; raise to record the item's error
        (after the backend's own retries), ``LaneLost`` to hand the task to another lane."""

    def describe(self) -> dict[str, Any]:
        """The sampling metadata written beside each output line."""
        return {"sampler": self.kind, "model": self.model_name(), "params": self.config.sampling_params(),
                "seed": self.config.seed}

    def model_name(self) -> str:
        return self.config.model or self.config.pipeline or "?"

    # ----------------------------------------------------------- scheduling
    async def stream(self, work: WorkQueue) -> AsyncIterator[ItemResult]:
        """Run ``work`` over the lanes; yield each task's result as it completes.

        Leaving the iteration early cancels the lanes (their requests are aborted).
        Raises ``SamplerUnavailable`` if every lane is lost while tasks remain.
        """
        results: asyncio.Queue[ItemResult | BaseException | None] = asyncio.Queue()
        lanes = list(self.lanes())
        if not lanes:
            raise SamplerUnavailable(f"{self.kind} sampler: no worker left to sample with")
        live = len(lanes)

        async def run_lane(lane: Any) -> None:
            nonlocal live
            try:
                while (task := await work.get()) is not None:
                    try:
                        responses = await self.sample(task, lane)
                    except LaneLost as exc:
                        logger.warning("%s sampler: lane %s lost (%s); item %s goes to another lane",
                                       self.kind, lane, exc, task.item_id)
                        work.requeue(task)
                        return
                    except Exception as exc:  # noqa: BLE001 - recorded as the item's error
                        results.put_nowait(ItemResult(task.item_id, task.round, [], f"{type(exc).__name__}: {exc}"))
                    else:
                        results.put_nowait(ItemResult(task.item_id, task.round, responses))
                    finally:
                        work.task_done()
            finally:
                live -= 1
                if live == 0:
                    pending = len(work)
                    results.put_nowait(SamplerUnavailable(f"{self.kind} sampler: no worker left; {pending} tasks "
                                                          "not run") if pending else None)

        runners = [asyncio.create_task(run_lane(lane)) for lane in lanes]
        try:
            while (result := await results.get()) is not None:
                if isinstance(result, BaseException):
                    raise result
                yield result
        finally:
            for runner in runners:
                runner.cancel()
            await asyncio.gather(*runners, return_exceptions=True)

    async def sample_batch(self, items: list[dict[str, Any]], n: int) -> BatchResult:
        """The seed's call: ``n`` responses per item, ``{item_id: [Response, ...]}``; an item
        that failed maps to ``[]`` with its message in ``.errors``."""
        checked = [check_item(item, f"items[{i}]") for i, item in enumerate(items)]
        work = WorkQueue((SampleTask(item, n, 0, item_seed(self.config.seed, item["id"], 0)) for item in checked),
                         closed=True)
        responses: dict[str, list[Response]] = {item["id"]: [] for item in checked}
        errors: dict[str, str] = {}
        async for result in self.stream(work):
            responses[result.item_id] = result.responses
            if result.error is not None:
                errors[result.item_id] = result.error
        return BatchResult(responses, errors)
