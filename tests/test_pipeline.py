"""The real speech pipeline (SmolLM2 on vLLM -> eSpeak NG), end to end, through
``MultiStageEngineClient`` and ``PipelineOrchestrator``, on both architectures:
ZMQ stage processes (new) and ``multiprocessing.Queue`` ones (legacy), and with
the speech stage in-process (a thread of the client). Same tests, same outputs,
same errors; only shared-memory checks are new-only."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import time
import wave

import numpy as np
import pytest
import pytest_asyncio
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from omni_engine.audio import wav_bytes
from omni_engine.config import load_pipeline_config, parse_pipeline_config
from omni_engine.connectors.shm import list_segments
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.pipeline.orchestrator import PipelineOrchestrator
from omni_engine.pipeline.stage_context import StageContext
from omni_engine.errors import PipelineOverloadedError, StageDeadError
from omni_engine.legacy import start_legacy_pipeline
from omni_engine.metrics import OrchestratorMetrics
from tests.helpers import wait_group_gone

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.llm, pytest.mark.tts]

CONFIG = "stage_configs/smollm2_speech.yaml"
# The speech stage's runtime per architecture.
IN_PROCESS = {"new": {}, "legacy": {}, "inprocess": {"process": False},
              "inprocess-client-loop": {"process": False, "event_loop": "client"}}
STORY = "Tell me a short story about a cat."


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=["new", "legacy", "inprocess", "inprocess-client-loop"])
async def pipeline(request, smollm2_path):
    """``new``: stage processes over ZMQ; ``legacy``: over multiprocessing.Queue; ``inprocess``:
    the speech stage in a thread of the client (``runtime.process: false``), the LLM a process;
    ``inprocess-client-loop``: the speech stage on the client's event loop (``event_loop: client``)."""
    raw = load_pipeline_config(CONFIG)
    data = {
        "runtime": {"execution_mode": raw.runtime.execution_mode,
                    # Audio of a sentence is ~100-300 KB: through shared memory here, so the
                    # tests see leases taken and given back (the legacy architecture pickles).
                    "connectors": {"shm_threshold": 4096} if request.param != "legacy" else {}},
        "stage_args": [
            dict(
                stage_id=s.stage_id, stage_type=s.stage_type, engine_args=dict(s.engine_args),
                engine_input_source=s.engine_input_source, custom_process_input_func=s.custom_process_input_func,
                final_output=s.final_output, final_output_type=s.final_output_type,
                default_sampling_params=s.default_sampling_params,
                runtime={"max_batch_size": s.runtime.max_batch_size,
                         **(IN_PROCESS[request.param] if s.stage_type != "llm" else {})},
            )
            for s in raw.stage_args
        ],
    }
    data["stage_args"][0]["engine_args"]["model"] = str(smollm2_path)
    config = parse_pipeline_config(data, CONFIG)
    if request.param != "legacy":
        client = await MultiStageEngineClient.from_config(config)
    else:
        client = await start_legacy_pipeline(config)
    client.architecture = request.param
    yield client
    await client.shutdown_async()
    for ctx in client.stage_contexts:
        for replica in ctx.client.replicas:
            if replica.process is not None:
                assert not replica.process.is_alive()
            else:  # in-process: its thread or task has ended
                assert not replica.stage_running
            if is_new(client):
                assert not list_segments(replica.shm_prefix)


def is_new(client) -> bool:
    """ZMQ stage clients (in-process or not), as opposed to the legacy queues."""
    return client.architecture != "legacy"


async def run(client, prompt, request_id, **kw):
    """(events, outputs): events are (seconds, stage_id, finished) in arrival order."""
    loop = asyncio.get_running_loop()
    t0, events, outputs = loop.time(), [], []
    async with asyncio.timeout(180):
        async for out in client.generate(prompt, kw.pop("params", None), request_id, **kw):
            events.append((loop.time() - t0, out.stage_id, out.finished))
            outputs.append(out)
    return events, outputs


def text_of(outputs) -> str:
    return "".join(o.outputs[0].text for o in outputs if o.final_output_type == "text" and o.outputs)


def audio_of(outputs) -> tuple[np.ndarray, int]:
    chunks = [o.multimodal_output for o in outputs if o.final_output_type == "audio" and o.multimodal_output]
    return np.concatenate([c["audio"] for c in chunks]), chunks[0]["sample_rate"]


async def assert_no_request_state(client):
    counts = client.orchestrator.state_counts()
    assert counts["requests"] == 0 and counts["routes"] == 0, counts
    for ctx in client.stage_contexts:
        assert ctx.client.num_unfinished_requests() == 0
    # The reader that finished the last request exits after its batch.
    async with asyncio.timeout(1.0):
        while client.orchestrator.state_counts()["readers"]:
            await asyncio.sleep(0.01)


async def wait_leases_returned(client, timeout=10.0):
    """Every shared-memory slot of the speech stage is back in its pool."""
    import gc

    if not is_new(client):
        return None  # the legacy stages pass tensors as pickle does, not through our pool
    tts = client.stage_contexts[1].client
    async with asyncio.timeout(timeout):
        while True:
            gc.collect()
            stats = await tts.call_utility_async("shm_stats")
            if stats["leased"] == 0:
                return stats
            await asyncio.sleep(0.05)


async def test_answers_paris_in_text_and_a_valid_wav(pipeline, chat_prompt):
    events, outputs = await run(pipeline, chat_prompt("What is the capital of France?"), "paris")
    assert "Paris" in text_of(outputs)
    audio, rate = audio_of(outputs)
    data = wav_bytes(audio, rate)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 22050)
        assert 0.8 < w.getnframes() / rate < 15
    assert float(np.sqrt(np.mean(audio ** 2))) > 0.01
    # Exactly one finished output per final stage, each the last of its stage.
    for sid in (0, 1):
        finished = [i for i, (_, s, f) in enumerate(events) if s == sid and f]
        assert len(finished) == 1 and finished[0] == max(i for i, (_, s, _) in enumerate(events) if s == sid)
    assert all(o.request_id == "paris" for o in outputs)
    if is_new(pipeline):
        # Every output names the weights of the text stage that made it or its input (audio too).
        assert all(o.stage_versions == {0: ["default"]} for o in outputs), {o.stage_versions for o in outputs}
    await assert_no_request_state(pipeline)
    del outputs, audio
    await wait_leases_returned(pipeline)


async def test_async_chunk_speaks_before_the_text_is_finished(pipeline, chat_prompt):
    params = SamplingParams(temperature=0.0, max_tokens=60, output_kind=RequestOutputKind.DELTA)
    events, outputs = await run(pipeline, chat_prompt(STORY), "story-async", params=params,
                                execution_mode="async_chunk")
    text_done = next(t for t, s, f in events if s == 0 and f)
    first_audio = next(t for t, s, _ in events if s == 1)
    assert first_audio < text_done, events
    assert sum(1 for _, s, _ in events if s == 1) >= 2, "expected one audio chunk per sentence"


async def test_each_sentence_reaches_the_speech_stage_due_when_its_listener_needs_it(pipeline, chat_prompt):
    """The orchestrator stamps every piece of a spoken answer with its playback deadline: the first is
    due at the request's start, each later one when the pieces before it have played at 1x
    (estimated from their text until their audio came), and the speech stage saw those deadlines."""
    t0 = time.time()
    _, outputs = await run(pipeline, chat_prompt(STORY), "due", params=SamplingParams(
        temperature=0.0, max_tokens=48, output_kind=RequestOutputKind.DELTA))
    pieces = [o.multimodal_output for o in outputs if o.final_output_type == "audio" and o.multimodal_output]
    seconds = [len(p["audio"]) / p["sample_rate"] for p in pieces]
    stats = await pipeline.stage_contexts[1].client.call_utility_async("deadline_stats")
    seen = {rid: deadline for rid, deadline in stats["recent"] if rid == "due" or rid.startswith("due#")}
    ids = ["due"] + [f"due#{k}" for k in range(1, len(pieces))]
    assert len(pieces) >= 2 and sorted(seen) == sorted(ids), (len(pieces), sorted(seen))
    due = [seen[rid] for rid in ids]
    assert t0 - 0.05 <= due[0] <= t0 + 1.0, (due[0] - t0)
    for k in range(1, len(due)):
        # Piece k is due after piece k-1 by about its length (estimated, or heard; plus the wait for
        # the first audio once it came).
        gap = due[k] - due[k - 1]
        assert 0.5 * seconds[k - 1] <= gap <= 2.0 * seconds[k - 1] + 2.0, (k, gap, seconds)


async def test_sequential_speaks_after_the_text_is_finished(pipeline, chat_prompt):
    params = SamplingParams(temperature=0.0, max_tokens=60, output_kind=RequestOutputKind.DELTA)
    events, outputs = await run(pipeline, chat_prompt(STORY), "story-seq", params=params,
                                execution_mode="sequential")
    text_done = next(t for t, s, f in events if s == 0 and f)
    first_audio = next(t for t, s, _ in events if s == 1)
    assert first_audio > text_done, events
    assert len(audio_of(outputs)[0]) > 22050  # the whole story, spoken at once


async def test_final_stage_id_skips_stages_not_needed(pipeline, chat_prompt):
    events, outputs = await run(pipeline, chat_prompt("What is the capital of France?"), "text-only",
                                final_stage_id=0)
    assert {s for _, s, _ in events} == {0} and "Paris" in text_of(outputs)


async def test_entry_stage_id_runs_the_speech_stage_alone(pipeline):
    llm_requests = pipeline.metrics.stage(0).requests
    events, outputs = await run(pipeline, "Hello world.", "speech-only", entry_stage_id=1,
                                params=[None, {"voice": "en", "speed": 1.0}])
    assert {s for _, s, _ in events} == {1} and pipeline.metrics.stage(0).requests == llm_requests
    audio, rate = audio_of(outputs)
    assert len(audio) / rate > 0.5 and float(np.sqrt(np.mean(audio ** 2))) > 0.01
    await assert_no_request_state(pipeline)
    del outputs, audio
    await wait_leases_returned(pipeline)


async def test_abort_mid_pipeline_leaves_no_state_or_leases(pipeline, chat_prompt):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    gen = pipeline.generate(chat_prompt(STORY), params, "to-abort")
    seen_audio = False
    async with asyncio.timeout(120):
        async for out in gen:
            if out.stage_id == 1:
                seen_audio = True
                break
    assert seen_audio
    await pipeline.abort("to-abort")
    # As vLLM's AsyncLLM: the stream ends with a final output per final stage, the text's
    # completion marked "abort" (both stages had started).
    rest = [o async for o in gen]
    finals = {o.stage_id: o for o in rest if o.finished}
    assert set(finals) == {0, 1} and finals[0].outputs[0].finish_reason == "abort", rest
    del out, rest, finals
    await assert_no_request_state(pipeline)
    await wait_leases_returned(pipeline)
    # The pipeline still serves.
    _, outputs = await run(pipeline, chat_prompt("What is the capital of France?"), "after-abort")
    assert "Paris" in text_of(outputs)


async def test_leaving_the_stream_early_aborts_everywhere(pipeline, chat_prompt):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    gen = pipeline.generate(chat_prompt(STORY), params, "dropped")
    async for _ in gen:
        break
    await gen.aclose()
    await assert_no_request_state(pipeline)
    assert pipeline.metrics.stage(0).aborted >= 1


async def test_concurrent_requests_all_complete(pipeline, chat_prompt):
    prompts = [chat_prompt(q) for q in ("What is the capital of France?", "Name a colour.", "Say hello.")]
    results = await asyncio.gather(*(run(pipeline, p, f"c{i}") for i, p in enumerate(prompts)))
    for events, outputs in results:
        assert text_of(outputs) and len(audio_of(outputs)[0]) > 0
    await assert_no_request_state(pipeline)


async def test_overload_is_refused_and_a_caller_that_stops_reading_is_cut_off(pipeline, chat_prompt):
    orch = pipeline.orchestrator
    saved = orch.max_inflight_requests, orch.max_undelivered_outputs
    orch.max_inflight_requests, orch.max_undelivered_outputs = 2, 8
    try:
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        # Two callers that stop reading after their first output.
        gens = [pipeline.generate(chat_prompt(STORY), params, f"unread-{i}", final_stage_id=0) for i in range(2)]
        for gen in gens:
            await gen.__anext__()
        # A third request is refused at once, as an HTTP 503 for vLLM's server.
        with pytest.raises(PipelineOverloadedError, match="max_inflight_requests") as info:
            await run(pipeline, chat_prompt("Hi"), "one-too-many", final_stage_id=0)
        assert info.value.http_status == 503 and info.value.request_id == "one-too-many"
        # The two that do not read are ended once 8 outputs wait for them.
        async with asyncio.timeout(60):
            while orch.num_requests:
                await asyncio.sleep(0.05)
        for i, gen in enumerate(gens):
            with pytest.raises(PipelineOverloadedError, match=f"unread-{i}.*max_undelivered_outputs"):
                await gen.__anext__()
        await assert_no_request_state(pipeline)
    finally:
        orch.max_inflight_requests, orch.max_undelivered_outputs = saved
    _, outputs = await run(pipeline, chat_prompt("What is the capital of France?"), "after-overload",
                           final_stage_id=0)
    assert "Paris" in text_of(outputs)


async def test_metrics_cover_every_stage(pipeline):
    for sid in (0, 1):
        m = pipeline.metrics.stage(sid)
        assert m.requests > 0 and m.finished > 0
        assert m.queue_time_s > 0
        if is_new(pipeline):  # multiprocessing.Queue cannot tell how many bytes it pickled
            assert m.bytes_in > 0 and m.bytes_out > 0
    request = pipeline.metrics.requests["paris"]
    assert 0 < request.time_to_first_output(0) <= request.time_to_first_output(1) <= request.e2e_s


async def test_seed_sequential_pipeline(pipeline):
    """The seed's orchestrator test (rfc967 测试计划), on the pipeline's text stage."""
    stage_contexts = [StageContext(0, None, pipeline.stage_contexts[0].client, is_final_output=True)]
    orchestrator = PipelineOrchestrator(
        stages=stage_contexts,
        execution_mode="sequential",
    )

    outputs = []
    async for output in orchestrator.process_pipeline(
        request_id="test-1",
        prompt="Hello",
        sampling_params_list=[SamplingParams()],
        metrics=OrchestratorMetrics(),
        final_stage_id=0,
    ):
        outputs.append(output)

    assert len(outputs) > 0
    assert outputs[-1].finished


async def test_health_and_protocol_surface(pipeline):
    await pipeline.check_health()
    assert pipeline.is_running and not pipeline.errored and pipeline.dead_error is None
    assert await pipeline.get_supported_tasks() == ("generate",)
    await pipeline.pause_generation(mode="wait")
    assert await pipeline.is_paused()
    await pipeline.resume_generation()
    assert not await pipeline.is_paused()
    with pytest.raises(NotImplementedError):
        pipeline.encode("x", None, "r")
    # collective_rpc reaches the vLLM workers of the LLM stage(s), or the chosen stages: one
    # result per worker, as vLLM's AsyncLLM.collective_rpc.
    per_worker = await pipeline.collective_rpc("get_supported_tasks")
    assert per_worker and all("generate" in tasks for tasks in per_worker)
    with pytest.raises(RuntimeError, match="stage 1 .*no utility method 'collective_rpc'"):
        await pipeline.collective_rpc("get_cache_block_size_bytes", stage_ids=[1])
    with pytest.raises(ValueError, match="no stage"):
        await pipeline.collective_rpc("x", stage_ids=[9])


# Last in this module: it kills the speech stage of the shared pipeline.
async def test_killed_stage_ends_its_requests_with_an_error_naming_it(pipeline, chat_prompt):
    if pipeline.architecture.startswith("inprocess"):
        pytest.skip("an in-process stage cannot be killed alone; test_in_process covers its death")
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    tts = pipeline.stage_contexts[1].client.replicas[0]
    gen = pipeline.generate(chat_prompt(STORY), params, "doomed")
    async with asyncio.timeout(120):
        async for out in gen:
            if out.stage_id == 1:
                break
    os.kill(tts.process.pid, signal.SIGKILL)
    with pytest.raises(StageDeadError) as info:
        # The client hears of the death at once (the process's pidfd); the bound says "no hang",
        # and on two loaded cores (CI, 2026-11-26) 2 s was once too short for the loop to get there.
        async with asyncio.timeout(15):
            async for _ in gen:
                pass
    assert info.value.stage_id == 1 and "stage 1" in str(info.value)
    with pytest.raises(StageDeadError):
        await pipeline.check_health()
    assert pipeline.errored and pipeline.dead_error is not None
    await assert_no_request_state(pipeline)
    assert not await wait_group_gone(tts.process.pid)
    if is_new(pipeline):
        assert not list_segments(tts.shm_prefix)
    # A request that needs the dead stage fails at once, naming it; one that
    # does not (text only) is still served.
    with pytest.raises(StageDeadError, match="stage 1"):
        await run(pipeline, chat_prompt("Hi"), "after-death")
    _, outputs = await run(pipeline, chat_prompt("What is the capital of France?"), "text-after-death",
                           final_stage_id=0)
    assert "Paris" in text_of(outputs)
