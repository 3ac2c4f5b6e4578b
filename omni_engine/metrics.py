"""Orchestrator metrics: per stage and per request, in plain numbers.

Kept free of any exporter so tests and benchmarks can read them directly;
the Prometheus exporter reads these same objects.
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
        metrics = self.requests.get(request_id)
        if metrics is None:
            if len(self.requests) >= self.max_requests_kept:
                del self.requests[next(iter(self.requests))]
            metrics = self.requests[request_id] = RequestMetrics()
        return metrics
