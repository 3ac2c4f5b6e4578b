"""The ``generation`` stage engine: a batched model named by dotted path.

Requests that arrive while a batch is running wait and go together in the
next one (up to ``runtime.max_batch_size``), which is how a TTS or vocoder
model gets throughput without adding latency at low load. The batcher task
sleeps on an event: no timer, no polling.

The queue is served earliest deadline first (``omni_engine.deadlines``): a piece of speech
whose listener is about to run dry goes before one that is needed later. A model that renders
one request at a time anyway (``renders_alone``: eSpeak, Piper) is handed one at a time, so the
next pick is made after every piece and each answer leaves as soon as it exists, instead of a
batch of eight answering when its last is done. A model that batches only requests of one shape
(``batch_key``: a vocoder's windows of one length) is handed, with the earliest, only the queued
requests of its key, for the same reason.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from typing import Any

from omni_engine.deadlines import DeadlineStats, EdfQueue, effective_deadline
from omni_engine.engines.base import StageEngine, StageEngineError
from omni_engine.engines.generation_model import GenerationModel, GenerationRequest
from omni_engine.engines.loop_holds import LoopHoldReport, timed_steps
from omni_engine.stage_output import StageRequestOutput
from omni_engine.utils import resolve_dotted

logger = logging.getLogger(__name__)

MODEL_FACTORY_KEY = "model_factory"


class _Pending:
    __slots__ = ("request", "future", "deadline")

    def __init__(self, request: GenerationRequest, future: asyncio.Future, deadline: float) -> None:
        self.request = request
        self.future = future
        self.deadline = deadline


class GenerationStageEngine(StageEngine):
    UTILITY_METHODS = StageEngine.UTILITY_METHODS | {"deadline_stats", "engine_metrics"}

    def __init__(
        self,
        stage_id: int,
        engine_args: dict[str, Any],
        max_batch_size: int = 1,
        final_output_type: str | None = None,
    ) -> None:
        super().__init__(stage_id)
        args = dict(engine_args)
        factory_path = args.pop(MODEL_FACTORY_KEY, None)
        if factory_path is None:
            raise ValueError(f"stage {stage_id}: generation engine_args need {MODEL_FACTORY_KEY!r} (a dotted path)")
        self._factory = resolve_dotted(factory_path, f"stage {stage_id} engine_args.{MODEL_FACTORY_KEY}")
        self._factory_args = args
        if max_batch_size < 1:
            raise ValueError(f"stage {stage_id}: runtime.max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self._final_output_type = final_output_type
        self.model: GenerationModel | None = None
        self._queue: EdfQueue[_Pending] = EdfQueue()
        self._batch_limit = max_batch_size  # 1 for a model that renders alone (set at start)
        self._key: Callable[[_Pending], Hashable] | None = None  # the model's batch_key, if any (set at start)
        self.deadlines = DeadlineStats()
        self._pending: dict[str, _Pending] = {}
        self._wakeup = asyncio.Event()
        self._batcher: asyncio.Task | None = None
        # The batch being computed and the model call computing it: cancelled
        # once every request in it is aborted, so the stage is free again.
        self._running: tuple[list[_Pending], asyncio.Task] | None = None
        self.loop_holds: LoopHoldReport | None = None  # set where the loop is shared (watch_loop_holds)

    @property
    def output_type(self) -> str:
        return self._final_output_type or (self.model.output_type if self.model else "audio")

    async def start(self) -> None:
        model = self._factory(**self._factory_args)
        if not isinstance(model, GenerationModel):
            raise TypeError(f"stage {self.stage_id}: factory returned {type(model).__name__}, not a GenerationModel")
        self.model = model
        if getattr(model, "renders_alone", False):
            self._batch_limit = 1
        if hasattr(model, "batch_key"):
            self._key = self._batch_key
        self._batcher = asyncio.create_task(self._run_batches(), name=f"stage{self.stage_id}-batcher")

    def submit(self, request_id: str, prompt: Any, sampling_params: Any,
               deadline: float | None = None) -> asyncio.Future:
        """Queue the request (earliest deadline first); the future holds its one output."""
        future = asyncio.get_running_loop().create_future()
        if self._batcher is None or self._batcher.done():
            future.set_exception(StageEngineError(f"stage {self.stage_id}: generation batcher is not running"))
            return future
        pending = _Pending(GenerationRequest(request_id, prompt, sampling_params), future,
                           effective_deadline(deadline))
        self._pending[request_id] = pending
        self._queue.push(pending, pending.deadline)
        self._wakeup.set()
        future.add_done_callback(functools.partial(self._settled, pending))
        return future

    def _settled(self, pending: _Pending, future: asyncio.Future) -> None:
        """A request's future is done: answered, failed, or cancelled (aborted)."""
        pending.request.aborted = True  # a no-op if answered; stops the model if cancelled
        request_id = pending.request.request_id
        if self._pending.get(request_id) is pending:
            del self._pending[request_id]
        self._cancel_abandoned_batch()

    async def generate(self, request_id: str, prompt: Any, sampling_params: Any,
                       deadline: float | None = None) -> AsyncIterator[StageRequestOutput]:
        yield await self.submit(request_id, prompt, sampling_params, deadline)

    def _output(self, request_id: str, result: dict[str, Any]) -> StageRequestOutput:
        return StageRequestOutput(request_id, finished=True, stage_id=self.stage_id,
                                 final_output_type=self.output_type, multimodal_output=result)

    async def _run_batches(self) -> None:
        assert self.model is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = self._take_batch()
                if batch:
                    await self._run_batch(batch)

    def _take_batch(self) -> list[_Pending]:
        """The earliest-deadline request and, up to the batch limit, the next earliest that the model
        renders in the same pass as it (``batch_key``). A model that renders a batch as several
        passes returns every answer after the last, so a stream's first piece taken with seven later
        pieces of other lengths waited for all of them; taken by key, it leaves after its own pass,
        and the next batch is picked by deadline again."""
        return [pending for pending, _ in self._queue.pop_batch(
            self._batch_limit, self._key, live=lambda pending: not pending.future.done())]

    def _batch_key(self, pending: _Pending) -> Hashable:
        """The model's ``batch_key``; a request it cannot key goes alone (rendering it names the error)."""
        try:
            return self.model.batch_key(pending.request)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - _render_batch reports what is wrong with it
            return object()

    async def _run_batch(self, batch: list[_Pending]) -> None:
        assert self.model is not None
        for pending in batch:
            self.deadlines.started(pending.request.request_id, pending.deadline)
        if self.on_work_started is not None:  # (a traced request may be in it)
            for pending in batch:
                self.on_work_started(pending.request.request_id, None)
        coro = self.model.generate([p.request for p in batch])
        if self.loop_holds is not None:
            coro = timed_steps(coro, self.loop_holds.limit_s, self.loop_holds)
        call = asyncio.create_task(coro)
        self._running = (batch, call)
        try:
            results = await call
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the batcher itself is stopped (shutdown)
            logger.debug("stage %d: batch of %d cancelled: all its requests were aborted", self.stage_id, len(batch))
            return
        except Exception as exc:  # noqa: BLE001 - fails this batch only
            logger.exception("stage %d: batch of %d failed", self.stage_id, len(batch))
            results = [exc] * len(batch)
        finally:
            self._running = None
        if len(results) != len(batch):
            error = StageEngineError(f"model returned {len(results)} results for a batch of {len(batch)}")
            results = [error] * len(batch)
        now = time.time()
        for pending, result in zip(batch, results):
            self.deadlines.finished(pending.deadline, now)
            if pending.future.done():
                continue
            if isinstance(result, BaseException):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(self._output(pending.request.request_id, result))

    def _cancel_abandoned_batch(self) -> None:
        """Stop the model call of a batch nobody waits for any more: a model that
        ignores ``request.aborted`` would otherwise hold the stage until it ends."""
        if self._running is not None:
            batch, call = self._running
            if all(p.future.done() for p in batch):
                call.cancel()

    async def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            pending = self._pending.pop(request_id, None)
            if pending is not None:
                pending.request.aborted = True
                pending.future.cancel()
        self._cancel_abandoned_batch()

    def deadline_stats(self) -> dict[str, Any]:
        """Pieces served, how many after their deadline (made anyway), the worst lateness, and the
        ids of the last ones in the order their work began."""
        return self.deadlines.snapshot()

    def engine_metrics(self) -> list[Any]:
        """This stage's deadline figures as metric families, for the server's ``/metrics``."""
        return self.deadlines.families()

    def watch_loop_holds(self) -> LoopHoldReport:
        self.loop_holds = LoopHoldReport(self.stage_id)
        return self.loop_holds

    def num_unfinished_requests(self) -> int:
        return len(self._pending)

    def num_running(self) -> int | None:
        """Requests in the batch the model computes now (None: no batch is running)."""
        return len(self._running[0]) if self._running is not None else None

    async def check_health(self) -> None:
        if self._batcher is None or self._batcher.done():
            raise StageEngineError(f"stage {self.stage_id}: generation batcher is not running")

    def info(self) -> dict[str, Any]:
        info = dict(self.model.info()) if self.model else {}
        info.update(engine=info.get("engine", "generation"), output_type=self.output_type,
                    max_batch_size=self.max_batch_size)
        return info

    async def shutdown(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
            self._batcher = None
        for pending in self._pending.values():
            pending.future.cancel()
        self._pending.clear()
        if self.model is not None:
            await self.model.shutdown()
            self.model = None
