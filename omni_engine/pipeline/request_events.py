"""What a request's events add to the orchestrator's metrics.

Routing decides where an output goes; ``RequestEventRecorder`` only counts
(submits, outputs, forwards, errors, ends) and tells the optional
``PipelineObserver``, so that routing reads as routing and an observer's
failure can never touch a request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from omni_engine.errors import StageRequestError
from omni_engine.metrics import PipelineObserver

if TYPE_CHECKING:
    from omni_engine.pipeline.request_state import ClientRequestState

logger = logging.getLogger(__name__)


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
        if state.trace is not None:
            state.trace.failed(getattr(error, "stage_id", None), str(error))
        if isinstance(error, StageRequestError):
            state.pipeline_metrics.stage(error.stage_id).failed += 1
            self._observe("on_error", error.stage_id, error.error_type)

    def aborted(self, state: ClientRequestState, sid: int, n: int) -> None:
        state.pipeline_metrics.stage(sid).aborted += n

    def done(self, state: ClientRequestState, error: BaseException | None) -> None:
        state.metrics.finished = asyncio.get_running_loop().time()
        if self.observer is None and state.trace is None:
            return
        outcome = ("finished" if error is None
                   else "aborted" if isinstance(error, asyncio.CancelledError) else "failed")
        if state.trace is not None:
            try:
                state.trace.end(outcome, None if error is None else str(error) or type(error).__name__,
                                tuple(sorted(state.final_stages)))
            except Exception:  # noqa: BLE001 - tracing must never break a request
                logger.exception("ending the trace of request %s failed", state.request_id)
        if self.observer is None:
            return
        ttfo = {sid: max(0.0, t) for sid in sorted(state.final_stages)
                if (t := state.metrics.time_to_first_output(sid)) is not None}
        self._observe("on_request_done", max(0.0, state.metrics.e2e_s or 0.0), ttfo, outcome,
                      tuple(sorted(state.final_stages)))
