"""Traces across stage processes: a request's spans, as an OTLP collector receives them.

Real stage processes (the tensor pipeline: a source whose output crosses to a sink in
shared memory) behind a ``MultiStageEngineClient`` with ``runtime.otlp_traces_endpoint``;
the receiver decodes what arrives with the official protobuf types. The served path (the
HTTP ``traceparent``, vLLM's own span under the llm stage's) is in ``test_serve_audio``.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest
import pytest_asyncio

from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.tracing.request_trace import REQUEST_SPAN, STAGE_SPAN
from tests.helpers import tensor_pipeline_config
from tests.otlp_receiver import OtlpReceiver, otlp_over_http

pytestmark = pytest.mark.asyncio(loop_scope="session")

NBYTES = 1 << 20  # above the shared-memory threshold: the source's tensor crosses in a segment


def caller_context() -> tuple[str, str, dict[str, str]]:
    """A caller's trace id, span id and the ``traceparent`` carrying them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01"}


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as rx:
        yield rx


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def traced(receiver):
    with otlp_over_http():
        client = await MultiStageEngineClient.from_config(tensor_pipeline_config().with_traces_endpoint(receiver.url))
    yield client
    await client.shutdown_async()


def by_name(spans) -> dict[str, object]:
    return {s.name: s for s in spans}


async def test_a_request_is_one_trace_under_the_callers_span_with_a_span_per_stage(traced, receiver):
    trace_id, caller_span, headers = caller_context()
    assert await traced.is_tracing_enabled()
    since = len(receiver.spans)
    outputs = [o async for o in traced.generate({"nbytes": NBYTES}, None, "traced-1", trace_headers=headers)]
    assert outputs[-1].multimodal_output["nbytes"] == NBYTES
    # (The module's first request: every span after ``since`` is this request's.)
    new = receiver.wait_for_new(since, 3)
    strays = [(s.name, s.trace_id) for s in new if s.trace_id != trace_id]
    assert not strays, f"spans of the request went into another trace than the caller's {trace_id}: {strays}"
    spans = by_name(receiver.wait_for(trace_id, lambda s: len(s) >= 3))
    assert set(spans) == {REQUEST_SPAN, f"{STAGE_SPAN} tensor_source", f"{STAGE_SPAN} tensor_sink"}
    root = spans[REQUEST_SPAN]
    assert root.parent_span_id == caller_span
    assert root.attributes["gen_ai.request.id"] == "traced-1"
    assert root.attributes["omni.request.outcome"] == "finished" and not root.is_error
    pids = {ctx.stage_id: ctx.client.ready.pid for ctx in traced.stage_contexts}
    for sid, name in ((0, "tensor_source"), (1, "tensor_sink")):
        span = spans[f"{STAGE_SPAN} {name}"]
        assert span.parent_span_id == root.span_id
        a = span.attributes
        assert (a["omni.stage.id"], a["omni.stage.name"], a["omni.stage.type"]) == (sid, name, "generation")
        assert a["omni.stage.sub_requests"] == 1 and a["omni.stage.outputs"] == 1 and not a["omni.stage.aborted"]
        assert a["omni.stage.pids"] == [pids[sid]]  # recorded in the stage process itself
        assert 0 <= a["gen_ai.latency.time_in_queue"] < a["omni.stage.time_to_first_output"]
        assert root.start_ns <= span.start_ns <= span.end_ns <= root.end_ns
        assert [name for name, _ in span.events] == ["first_output", "stage_started"]
    # The source's tensor went through shared memory; the sink's answer is a small dict.
    assert spans[f"{STAGE_SPAN} tensor_source"].attributes["omni.stage.shm_bytes"] == NBYTES
    assert spans[f"{STAGE_SPAN} tensor_sink"].attributes["omni.stage.shm_bytes"] == 0
    # The sink started after the source had finished (sequential): the spans say so.
    assert spans[f"{STAGE_SPAN} tensor_source"].end_ns <= spans[f"{STAGE_SPAN} tensor_sink"].start_ns


async def test_an_aborted_request_marks_the_spans_it_was_in(traced, receiver):
    trace_id, _, headers = caller_context()
    stream = traced.generate({"nbytes": 1024, "sink_delay": 5.0}, None, "traced-abort", trace_headers=headers)
    task = asyncio.ensure_future(stream.__anext__())
    # Once the sink has it (the source is done), abort.
    for _ in range(200):
        if traced.orchestrator.stage_load()[1] != (0, 0):
            break
        await asyncio.sleep(0.02)
    await traced.abort("traced-abort")
    with pytest.raises((StopAsyncIteration, asyncio.CancelledError)):
        while True:
            await asyncio.wait_for(task, 10)
            task = asyncio.ensure_future(stream.__anext__())
    spans = by_name(receiver.wait_for(trace_id, lambda s: len(s) >= 3))
    root, source, sink = spans[REQUEST_SPAN], spans[f"{STAGE_SPAN} tensor_source"], spans[f"{STAGE_SPAN} tensor_sink"]
    assert root.attributes["omni.request.outcome"] == "aborted" and root.is_error
    assert sink.is_error and sink.status_message == "aborted" and sink.attributes["omni.stage.aborted"]
    assert not source.is_error and not source.attributes["omni.stage.aborted"]


async def test_a_failed_stage_is_the_span_with_the_error(traced, receiver):
    trace_id, _, headers = caller_context()
    with pytest.raises(Exception, match="failed after writing its output"):
        async for _ in traced.generate({"nbytes": 1024, "fail": True}, None, "traced-fail", trace_headers=headers):
            pass
    spans = by_name(receiver.wait_for(trace_id, lambda s: len(s) >= 2))
    root, source = spans[REQUEST_SPAN], spans[f"{STAGE_SPAN} tensor_source"]
    assert f"{STAGE_SPAN} tensor_sink" not in spans  # never reached
    assert root.attributes["omni.request.outcome"] == "failed" and root.is_error
    assert source.is_error and "failed after writing its output" in source.status_message
    assert "traced-fail" in source.status_message  # the stage's error names the request


async def test_without_an_endpoint_nothing_is_traced_and_stages_record_nothing(receiver):
    client = await MultiStageEngineClient.from_config(tensor_pipeline_config())
    try:
        assert client.tracer is None and not await client.is_tracing_enabled()
        trace_id, _, headers = caller_context()
        outputs = [o async for o in client.generate({"nbytes": NBYTES}, None, "untraced", trace_headers=headers)]
        # No trace headers went to the stages, so they recorded and sent nothing.
        assert outputs[-1].finished and outputs[-1].stage_timing is None
    finally:
        await client.shutdown_async()
    await asyncio.sleep(0.5)
    assert receiver.trace(trace_id) == []
