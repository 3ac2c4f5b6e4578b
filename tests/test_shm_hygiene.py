"""Shared-memory hygiene: segments of ours in /dev/shm (``omni_<client pid>_...``), counted before
and after normal requests, aborts, kill -9 of a stage, kill -9 of the client followed by a new
client, and SIGTERM to the client and to a stage. Runs on the small tensor pipeline
(``tests.helpers.tensor_pipeline_config``): an 8 MiB tensor crosses from source to sink as a
handle to a slot of the source's pool, which the request holds until it ends."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import pytest_asyncio

from omni_engine.connectors.shm import list_segments
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.errors import StageDeadError
from tests.helpers import process_exists, tensor_pipeline_config, wait_group_gone
from tests.leak_helpers import leftover_semaphores, semaphore_names
from tests.stress.checks import after_shutdown, wait_clean

pytestmark = pytest.mark.asyncio(loop_scope="session")

REPO = Path(__file__).resolve().parents[1]
NBYTES = 8 << 20
HELD = 600.0  # seconds the sink takes for a held request: in flight until aborted or killed


@pytest.fixture(scope="module", autouse=True)
def no_semaphore_left():
    """Nor does any of these ways to end leave a named semaphore (/dev/shm/sem.mp-*)."""
    before = semaphore_names()
    yield
    assert not leftover_semaphores(before)


def segments_of(pid: int | None = None) -> list[str]:
    """Our segments in /dev/shm: those of runs of the client ``pid`` (default: this process)."""
    return list_segments(f"omni_{pid or os.getpid()}_")


def socket_dirs_of(pid: int) -> list[Path]:
    return sorted(Path(tempfile.gettempdir()).glob(f"omni-{pid}-s*"))


async def wait_until(condition, timeout: float, what: str) -> None:
    """Poll ``condition()`` (sync or async) until true; fail naming ``what`` after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if loop.time() > deadline:
            pytest.fail(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)


async def leased(stage_client) -> int:
    return (await stage_client.call_utility_async("shm_stats"))["leased"]


async def start_held_request(client: MultiStageEngineClient, request_id: str) -> asyncio.Task:
    """A request that is in the sink, holding a slot of the source, read by a task."""

    async def read() -> list:
        return [o async for o in client.generate({"nbytes": NBYTES, "sink_delay": HELD}, None, request_id)]

    task = asyncio.create_task(read())
    source, sink = (ctx.client.replicas[0] for ctx in client.stage_contexts)
    await wait_until(lambda: sink.num_unfinished_requests() == 1, 30, f"{request_id} in the sink")

    async def slot_leased() -> bool:
        return await leased(source) >= 1

    await wait_until(slot_leased, 10, "the source's slot leased for it")
    return task


async def shut_down(client: MultiStageEngineClient) -> None:
    await client.shutdown_async()
    assert not await after_shutdown(client)


# --------------------------------------------------------------- in this process
@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pipeline():
    before = segments_of()
    client = await MultiStageEngineClient.from_config(tensor_pipeline_config())
    yield client
    await shut_down(client)
    assert segments_of() == before


async def test_normal_requests_take_slots_and_give_them_back(pipeline):
    source = pipeline.stage_contexts[0].client.replicas[0]
    for i in range(3):
        outputs = [o async for o in pipeline.generate({"nbytes": NBYTES}, None, f"normal-{i}")]
        assert outputs[-1].finished and outputs[-1].multimodal_output["segment"].startswith(source.shm_prefix)
    assert list_segments(source.shm_prefix)  # the pool's slots, kept warm between requests
    assert not await wait_clean(pipeline)


async def test_aborts_mid_request_give_every_slot_back(pipeline):
    aborted = await start_held_request(pipeline, "abort-me")
    await pipeline.abort("abort-me")
    assert (await aborted)[-1].finished  # the stream ends with its final (aborted) output
    left = await start_held_request(pipeline, "leave-me")
    left.cancel()  # the caller goes away mid-request
    await asyncio.wait({left})
    assert not await wait_clean(pipeline)  # no request state anywhere, the source's slots back in its pool


async def test_a_reused_request_id_keeps_its_slot_until_it_ends_again(pipeline):
    """Ids may be reused once a request ended: the new request's slot is not given
    back early because an earlier request of that id ended (this once freed it mid-flight)."""
    outputs = [o async for o in pipeline.generate({"nbytes": NBYTES}, None, "reused")]
    assert outputs[-1].finished
    del outputs
    again = await start_held_request(pipeline, "reused")
    gc.collect()  # the client's own views of the slot die: the sink's request must still hold it
    await asyncio.sleep(0.2)  # a release would be on its way by now
    source = pipeline.stage_contexts[0].client.replicas[0]
    assert await leased(source) >= 1
    await pipeline.abort("reused")
    assert (await again)[-1].finished
    assert not await wait_clean(pipeline)


async def test_stage_deaths_mid_request_kill9_and_sigterm():
    """kill -9 of the source: its segments go at once. SIGTERM of the sink: a crash like any
    other, the request through it fails within 2 s naming the stage and the signal."""
    before = segments_of()
    client = await MultiStageEngineClient.from_config(tensor_pipeline_config())
    source, sink = (ctx.client.replicas[0] for ctx in client.stage_contexts)
    try:
        request = await start_held_request(client, "doomed")
        assert list_segments(source.shm_prefix)
        # The sink keeps its own mapping of the slot, so the request goes on without the source.
        os.kill(source.process.pid, signal.SIGKILL)
        await wait_until(lambda: not list_segments(source.shm_prefix), 5, "the dead source's segments unlinked")
        assert not request.done()
        os.kill(sink.process.pid, signal.SIGTERM)
        with pytest.raises(StageDeadError) as info:
            async with asyncio.timeout(2):
                await request
        assert info.value.stage_id == 1 and "stage 1" in str(info.value) and "SIGTERM" in str(info.value)
        await wait_until(lambda: not sink.process.is_alive(), 10, "the SIGTERMed stage exited")
        assert sink.process.exitcode == 128 + signal.SIGTERM
        assert client.orchestrator.num_requests == 0
    finally:
        await shut_down(client)
    assert segments_of() == before


# ------------------------------------------------------------ the client process dies
async def start_child_client() -> tuple[asyncio.subprocess.Process, dict]:
    """``tests/shm_client_child.py`` in its own session; returns once its request holds a slot."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.shm_client_child", cwd=REPO, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    lines = []
    try:
        async with asyncio.timeout(120):
            while not (line := (await proc.stdout.readline()).decode()).startswith("ready "):
                if not line:
                    raise RuntimeError("child client exited before it was ready:\n" + "".join(lines[-30:]))
                lines.append(line)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc, json.loads(line[len("ready "):])


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def children():
    """Three child clients, started together (each loads torch and vLLM: slow, so in parallel)."""
    started = await asyncio.gather(*(start_child_client() for _ in range(3)), return_exceptions=True)
    yield [c for c in started if not isinstance(c, BaseException)]
    for item in started:
        if isinstance(item, BaseException):
            raise item
        proc, _ = item
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_kill9_of_a_client_then_a_new_client_removes_what_the_dead_runs_left(children):
    (alone, alone_info), (with_stages, with_stages_info) = children[0], children[1]
    # A: only the client is killed. Its stages die with it (PDEATHSIG) and free their own
    # pools on the way; its socket dirs were the client's to remove.
    os.kill(alone.pid, signal.SIGKILL)
    # B: the client and its stages, stopped first so that nothing of that run can clean up.
    for pid in with_stages_info["stages"]:
        os.kill(pid, signal.SIGSTOP)
    os.kill(with_stages.pid, signal.SIGKILL)
    for pid in with_stages_info["stages"]:
        os.kill(pid, signal.SIGKILL)
    await asyncio.gather(alone.wait(), with_stages.wait())
    stage_pids = alone_info["stages"] + with_stages_info["stages"]
    await wait_until(lambda: not any(process_exists(p) for p in stage_pids), 15, "the dead clients' stages exit")
    dead = [alone_info["pid"], with_stages_info["pid"]]
    assert all(socket_dirs_of(pid) for pid in dead)
    assert segments_of(with_stages_info["pid"])  # stale: their owner is dead
    client = await MultiStageEngineClient.from_config(tensor_pipeline_config())
    try:
        for pid in dead:
            assert not segments_of(pid), segments_of(pid)
            assert not socket_dirs_of(pid), socket_dirs_of(pid)
    finally:
        await shut_down(client)


async def test_sigterm_to_the_client_shuts_every_stage_down_and_leaves_nothing(children):
    proc, info = children[2]
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(30):
        output = (await proc.stdout.read()).decode()
        assert await proc.wait() == 0, output[-3000:]
    for stage_pid in info["stages"]:
        assert not process_exists(stage_pid)
        assert not await wait_group_gone(stage_pid)
    assert not segments_of(info["pid"])
    assert not socket_dirs_of(info["pid"])
