"""A request's spans: ``RequestTrace`` (one per traced request) made by ``PipelineTracer``.

The trace of a request through a pipeline:

    omni_request                      (kind SERVER; child of the caller's ``traceparent``)
      ├─ omni_stage <name>            one per stage the request visits (all its sub-requests)
      │    └─ llm_request             vLLM's own span, exported by an llm stage that has an endpoint
      └─ omni_stage <name> ...

The orchestrator tells the trace what it sees (submits, outputs, a stage done, the end);
each stage's final output of a sub-request brings what the stage process recorded
(``StageTiming``: queue wait, first output, outputs, shared-memory bytes). Spans are
opened as the request goes and ended with explicit times, so a stage's span shows when
the pipeline handed it work and when it was done, in the stage's own words where it has them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from omni_engine.stage_output import audio_seconds
from omni_engine.tracing.propagation import headers_of, parent_context
from omni_engine.tracing.stage_timing import StageTiming
from omni_engine.tracing.turn_trace import TurnTrace

REQUEST_SPAN = "omni_request"
STAGE_SPAN = "omni_stage"
# Seconds a shutdown waits for the last spans to leave.
SHUTDOWN_TIMEOUT_S = 5.0


class StageSpanAttributes:
    """Attribute names of the spans (OpenTelemetry's ``gen_ai.*`` where one means the same)."""

    REQUEST_ID = "gen_ai.request.id"
    OUTCOME = "omni.request.outcome"
    FINAL_STAGES = "omni.request.final_stages"
    STAGE_ID = "omni.stage.id"
    STAGE_NAME = "omni.stage.name"
    STAGE_TYPE = "omni.stage.type"
    REPLICAS = "omni.stage.replicas"
    PIDS = "omni.stage.pids"
    SUB_REQUESTS = "omni.stage.sub_requests"
    QUEUE_WAIT = "gen_ai.latency.time_in_queue"
    TIME_TO_FIRST_OUTPUT = "omni.stage.time_to_first_output"
    OUTPUTS = "omni.stage.outputs"
    COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    AUDIO_SECONDS = "omni.stage.audio_seconds"
    SHM_BYTES = "omni.stage.shm_bytes"
    ABORTED = "omni.stage.aborted"


A = StageSpanAttributes


@dataclass
class _StageSpan:
    """What one stage did for the request, gathered until its span ends."""

    span: Any
    started_ns: int
    headers: dict[str, str]
    sub_requests: int = 0
    replicas: set[int] = field(default_factory=set)
    first_output_ns: int = 0
    outputs: int = 0
    # Tokens per sub-request (the last cumulative count, or the sum of deltas).
    tokens: dict[str, int] = field(default_factory=dict)
    audio_s: float = 0.0
    timings: list[StageTiming] = field(default_factory=list)
    error: str | None = None
    ended: bool = False


class RequestTrace:
    """The spans of one request (see the module docstring)."""

    def __init__(self, tracer: Any, request_id: str, trace_headers: Mapping[str, str] | None,
                 stage_names: Mapping[int, tuple[str, str]]) -> None:
        self.tracer = tracer
        self.request_id = request_id
        self.stage_names = stage_names
        self.root = tracer.start_span(REQUEST_SPAN, context=parent_context(trace_headers), kind=SpanKind.SERVER,
                                      attributes={A.REQUEST_ID: request_id})
        self._root_context = trace.set_span_in_context(self.root)
        self.stages: dict[int, _StageSpan] = {}

    def submitting(self, stage_id: int) -> dict[str, str]:
        """A sub-request goes to ``stage_id``: the W3C headers of that stage's span (opened now)."""
        stage = self.stages.get(stage_id)
        if stage is None:
            name, kind = self.stage_names.get(stage_id, (f"stage{stage_id}", ""))
            now = time.time_ns()
            span = self.tracer.start_span(f"{STAGE_SPAN} {name}", context=self._root_context, start_time=now,
                                          attributes={A.STAGE_ID: stage_id, A.STAGE_NAME: name, A.STAGE_TYPE: kind,
                                                      A.REQUEST_ID: self.request_id})
            stage = self.stages[stage_id] = _StageSpan(span, now, headers_of(span))
        stage.sub_requests += 1
        return stage.headers

    def submitted(self, stage_id: int, replica: int | None) -> None:
        if replica is not None:
            self.stages[stage_id].replicas.add(replica)

    def output(self, stage_id: int, sub_id: str, output: Any, delta: bool) -> None:
        """An output of ``stage_id`` (``delta``: its text and tokens are new ones only)."""
        stage = self.stages.get(stage_id)
        if stage is None:
            return
        stage.outputs += 1
        if not stage.first_output_ns:
            stage.first_output_ns = time.time_ns()
            stage.span.add_event("first_output", timestamp=stage.first_output_ns)
        if output.outputs:
            n = len(output.outputs[0].token_ids or ())
            stage.tokens[sub_id] = stage.tokens.get(sub_id, 0) + n if delta else n
        stage.audio_s += audio_seconds(output)
        timing = getattr(output, "stage_timing", None) if output.finished else None
        if timing is not None:
            stage.timings.append(timing)

    def failed(self, stage_id: int | None, message: str) -> None:
        """The request failed at ``stage_id`` (None: not at a stage)."""
        stage = self.stages.get(stage_id) if stage_id is not None else None
        if stage is not None:
            stage.error = message

    def stage_done(self, stage_id: int, aborted: bool = False) -> None:
        """``stage_id`` has nothing more for the request (``aborted``: it ended that way)."""
        stage = self.stages.get(stage_id)
        if stage is not None and not stage.ended:
            self._end_stage(stage, time.time_ns(), aborted)

    def end(self, outcome: str, message: str | None = None, final_stages: tuple[int, ...] = ()) -> None:
        """The request ended (``outcome``: finished, failed or aborted); every span ends now."""
        now = time.time_ns()
        for stage in self.stages.values():
            if not stage.ended:
                self._end_stage(stage, now, aborted=outcome == "aborted")
        self.root.set_attribute(A.OUTCOME, outcome)
        self.root.set_attribute(A.FINAL_STAGES, list(final_stages))
        if outcome != "finished":
            self.root.set_status(Status(StatusCode.ERROR, message or outcome))
        self.root.end(end_time=now)

    def _end_stage(self, stage: _StageSpan, now: int, aborted: bool) -> None:
        stage.ended = True
        span = stage.span
        attributes: dict[str, Any] = {A.SUB_REQUESTS: stage.sub_requests, A.OUTPUTS: stage.outputs,
                                      A.ABORTED: aborted}
        if stage.replicas:  # (a stage of one replica has no replica set to say)
            attributes[A.REPLICAS] = sorted(stage.replicas)
        if stage.first_output_ns:
            attributes[A.TIME_TO_FIRST_OUTPUT] = (stage.first_output_ns - stage.started_ns) / 1e9
        if stage.tokens:
            attributes[A.COMPLETION_TOKENS] = sum(stage.tokens.values())
        if stage.audio_s:
            attributes[A.AUDIO_SECONDS] = round(stage.audio_s, 6)
        if stage.timings:
            waits = [w for t in stage.timings if (w := t.queue_wait_s) is not None]
            if waits:
                attributes[A.QUEUE_WAIT] = waits[0]  # the first sub-request's: what first output waited on
            attributes[A.SHM_BYTES] = sum(t.shm_bytes for t in stage.timings)
            attributes[A.PIDS] = sorted({t.pid for t in stage.timings})
            for t in stage.timings:
                if t.started:
                    span.add_event("stage_started", timestamp=int(t.started * 1e9))
        span.set_attributes(attributes)
        if stage.error is not None:
            span.set_status(Status(StatusCode.ERROR, stage.error))
        elif aborted:
            span.set_status(Status(StatusCode.ERROR, "aborted"))
        span.end(end_time=max(now, stage.started_ns))


class PipelineTracer:
    """Opens a ``RequestTrace`` per request and owns the exporter the spans leave through."""

    def __init__(self, tracer_provider: Any, stage_names: Mapping[int, tuple[str, str]]) -> None:
        """``stage_names``: stage id -> (name, stage type), for span names and attributes."""
        self.provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("omni_engine.pipeline")
        self.stage_names = dict(stage_names)

    def start_request(self, request_id: str, trace_headers: Mapping[str, str] | None) -> RequestTrace:
        return RequestTrace(self.tracer, request_id, trace_headers, self.stage_names)

    def start_turn(self, item_id: str | None, trace_headers: Mapping[str, str] | None) -> TurnTrace:
        """A realtime session's turn (``turn_trace``), under the session's own trace context."""
        return TurnTrace(self.tracer, item_id, trace_headers)

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Export what is pending, then stop the exporter; waits at most ``timeout`` seconds (a
        collector that does not answer is not worth a hung shutdown: its spans are lost)."""
        worker = threading.Thread(target=self.provider.shutdown, name="omni-trace-shutdown", daemon=True)
        worker.start()
        worker.join(timeout)
