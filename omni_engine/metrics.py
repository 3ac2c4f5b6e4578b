"""Orchestrator metrics: per stage and per request, in plain numbers, and what the
orchestrator's routing events mean for them.

Kept free of any exporter so tests and benchmarks can read them directly;
the Prometheus exporter reads these same objects, or observes the events as
they happen (``PipelineObserver``). Routing decides where an output goes;
``RequestEventRecorder`` only counts, so that routing reads as routing and an
observer's failure can never touch a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omni_engine.errors import StageRequestError

if TYPE_CHECKING:
    from omni_engine.pipeline.request_state import ClientRequestState

logger = logging.getLogger(__name__)


@dataclass
class StageMetrics:
    """Accumulated over all requests of one stage."""

    requests: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    # Submit -> first output: the time a request waits for the stage.
    queue_time_s: float = 0.0
    # First output -> finished: the time the stage works on it.
    run_time_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    outputs: int = 0

    @property
    def mean_queue_time_s(self) -> float:
        return self.queue_time_s / self.finished if self.finished else 0.0

    @property
    def mean_run_time_s(self) -> float:
        return self.run_time_s / self.finished if self.finished else 0.0


@dataclass
class RequestMetrics:
    """One request through the pipeline (monotonic clock)."""

    arrival: float = field(default_factory=time.monotonic)
    first_output: dict[int, float] = field(default_factory=dict)
    stage_done: dict[int, float] = field(default_factory=dict)
    finished: float | None = None

    def time_to_first_output(self, stage_id: int) -> float | None:
        t = self.first_output.get(stage_id)
        return None if t is None else t - self.arrival

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass
class OrchestratorMetrics:
    """What a ``PipelineOrchestrator`` measured: per stage totals, per request timings."""

    stages: dict[int, StageMetrics] = field(default_factory=dict)
    requests: dict[str, RequestMetrics] = field(default_factory=dict)
    # Finished requests kept for inspection; bounded so a server does not grow.
    max_requests_kept: int = 1024

    def stage(self, stage_id: int) -> StageMetrics:
        metrics = self.stages.get(stage_id)
        if metrics is None:
            metrics = self.stages[stage_id] = StageMetrics()
        return metrics

    def request(self, request_id: str) -> RequestMetrics:
        """The timings of ``request_id``, started now if it is new."""
        metrics = self.requests.get(request_id)
        return metrics if metrics is not None else self.new_request(request_id)

    def new_request(self, request_id: str) -> RequestMetrics:
        """Fresh timings for a request starting now (an id may be reused later)."""
        self.requests.pop(request_id, None)
        if len(self.requests) >= self.max_requests_kept:
            del self.requests[next(iter(self.requests))]
        metrics = self.requests[request_id] = RequestMetrics()
        return metrics


class PipelineObserver:
    """Optional hook of a ``PipelineOrchestrator`` (its ``observer``): told of each event as it happens.

    Every method is a no-op here; an exporter overrides what it needs. Times are
    seconds. Calls happen on the orchestrator's event loop and must not block;
    an exception in an observer is logged, never raised into the pipeline.
    """

    def on_submit(self, stage_id: int, nbytes: int) -> None:
        """A (sub-)request was sent to ``stage_id`` (``nbytes`` on the wire)."""

    def on_first_output(self, stage_id: int, queue_s: float) -> None:
        """A sub-request's first output: ``queue_s`` since its submit."""

    def on_finished(self, stage_id: int, run_s: float) -> None:
        """A sub-request finished: ``run_s`` since its first output."""

    def on_error(self, stage_id: int, error_type: str) -> None:
        """``stage_id`` reported (or routing its output raised) an error for a request."""

    def on_forward(self, src: int, dst: int, nbytes: int, seconds: float) -> None:
        """An input built from ``src``'s outputs went to ``dst``: ``seconds`` from src's output to dst's submit."""

    def on_request_done(self, e2e_s: float, ttfo_by_stage: dict[int, float], outcome: str,
                        final_stages: tuple[int, ...] = ()) -> None:
        """A request ended (``outcome``: finished, failed or aborted); TTFO per final stage that answered."""


class RequestEventRecorder:
    """Records submits, outputs, forwards, errors and ends of requests."""

    def __init__(self) -> None:
        # Told of every event as it happens; optional.
        self.observer: PipelineObserver | None = None

    def _observe(self, event: str, *args: Any) -> None:
        observer = self.observer
        if observer is None:
            return
        try:
            getattr(observer, event)(*args)
        except Exception:  # noqa: BLE001 - metrics must never break a request
            logger.exception("pipeline observer %s failed", event)

    def submitting(self, state: ClientRequestState, sid: int, k: int) -> None:
        state.pipeline_metrics.stage(sid).requests += 1
        state.stages[sid].submitted_at.setdefault(k, asyncio.get_running_loop().time())

    def submitted(self, state: ClientRequestState, sid: int, nbytes: int) -> None:
        state.pipeline_metrics.stage(sid).bytes_in += nbytes
        self._observe("on_submit", sid, nbytes)

    def forwarded(self, dst: int, nbytes: int, src_times: dict[int, float] | None) -> None:
        """A sub-request of ``dst`` was built from what each source produced at ``src_times``."""
        if self.observer is None or not src_times:
            return
        now = asyncio.get_running_loop().time()
        for src, t in src_times.items():
            self._observe("on_forward", src, dst, nbytes, max(0.0, now - t))

    def output(self, state: ClientRequestState, sid: int, k: int, now: float, finished: bool) -> None:
        track = state.stages[sid]
        stage_metrics = state.pipeline_metrics.stage(sid)
        stage_metrics.outputs += 1
        if k not in track.first_output_at:
            track.first_output_at[k] = now
            queue_s = now - track.submitted_at.get(k, now)
            stage_metrics.queue_time_s += queue_s
            state.metrics.first_output.setdefault(sid, now)
            self._observe("on_first_output", sid, queue_s)
        if finished:
            run_s = now - track.first_output_at[k]
            stage_metrics.finished += 1
            stage_metrics.run_time_s += run_s
            self._observe("on_finished", sid, run_s)

    def failed(self, state: ClientRequestState, error: BaseException) -> None:
        if isinstance(error, StageRequestError):
            state.pipeline_metrics.stage(error.stage_id).failed += 1
            self._observe("on_error", error.stage_id, error.error_type)

    def aborted(self, state: ClientRequestState, sid: int, n: int) -> None:
        state.pipeline_metrics.stage(sid).aborted += n

    def done(self, state: ClientRequestState, error: BaseException | None) -> None:
        state.metrics.finished = asyncio.get_running_loop().time()
        if self.observer is None:
            return
        outcome = ("finished" if error is None
                   else "aborted" if isinstance(error, asyncio.CancelledError) else "failed")
        ttfo = {sid: max(0.0, t) for sid in sorted(state.final_stages)
                if (t := state.metrics.time_to_first_output(sid)) is not None}
        self._observe("on_request_done", max(0.0, state.metrics.e2e_s or 0.0), ttfo, outcome,
                      tuple(sorted(state.final_stages)))
