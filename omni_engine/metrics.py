"""Orchestrator metrics: per stage and per request, in plain numbers, and what the
orchestrator's routing events mean for them.

Kept free of any exporter so tests and benchmarks can read them directly;
the Prometheus exporter reads these same objects, or observes the events as
they happen (``PipelineObserver``). What a request's events add to them is
``pipeline.request_events.RequestEventRecorder``: this module knows numbers,
not requests, and imports nothing of the pipeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


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
