"""Stage replicas (``runtime.num_replicas``): requests spread over them, a replica's death is
survived (retry before first output, eviction, restart of that replica only), and the
sub-requests of one request stay together with ``affinity: request``. Real stage processes."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from omni_engine.config import parse_pipeline_config
from omni_engine.connectors.shm import list_segments
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.errors import StageDeadError
from tests.helpers import TTS_FACTORY, speak, wait_group_gone
from tests.stress.checks import after_shutdown, wait_clean

pytestmark = [pytest.mark.asyncio(loop_scope="session")]

TEXT = " ".join(["The quick brown fox jumps over the lazy dog near the quiet river bank."] * 40)


def speech_replicas_config(**runtime):
    return parse_pipeline_config({"stage_args": [{
        "stage_id": 0, "stage_type": "generation", "engine_args": {"model_factory": TTS_FACTORY},
        "runtime": {"num_replicas": 2, "max_batch_size": 1, **runtime},
        "final_output": True, "final_output_type": "audio",
    }]}, "<replicas test>")


def assert_same_speech(audio: np.ndarray, reference: np.ndarray) -> None:
    """eSpeak NG's output for one text varies slightly from call to call, in one process too
    (lengths within ~0.2 %), so "equal" is: the same length and loudness within 1 %."""
    assert audio.dtype == reference.dtype
    assert abs(len(audio) - len(reference)) <= 0.01 * len(reference), (len(audio), len(reference))
    rms, ref_rms = float(np.sqrt(np.mean(audio ** 2))), float(np.sqrt(np.mean(reference ** 2)))
    assert abs(rms - ref_rms) <= 0.01 * ref_rms, (rms, ref_rms)


async def load_both(client, n: int, text: str = TEXT) -> list[asyncio.Task]:
    """``n`` requests in flight, until both replicas run some."""
    tasks = [asyncio.ensure_future(speak(client, text, f"load-{os.urandom(4).hex()}-{i}")) for i in range(n)]
    async with asyncio.timeout(10):
        while not all(s.in_flight >= 2 for s in client.replica_status(0)):
            await asyncio.sleep(0.005)
    return tasks


def exported(client, name: str) -> dict[tuple[str, ...], float]:
    """The samples of ``name`` on the server's /metrics collector: label values -> value."""
    from omni_engine.entrypoints.openai.metrics import PipelineMetricsCollector

    return {tuple(sample.labels.values()): sample.value
            for family in PipelineMetricsCollector(client).collect() for sample in family.samples
            if sample.name == name}


class HealthWatch:
    """Calls ``check_health`` over and over while running; keeps every failure."""

    def __init__(self, client) -> None:
        self.client, self.failures, self.checks = client, [], 0
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.client.check_health()
            except Exception as exc:  # noqa: BLE001 - recorded, asserted by the test
                self.failures.append(exc)
            self.checks += 1
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture(scope="module")
async def speech_replicas():
    client = await MultiStageEngineClient.from_config(speech_replicas_config(restart="on-failure"))
    yield client
    await client.shutdown_async()
    assert not await after_shutdown(client)


async def test_requests_spread_over_two_replicas_with_equal_outputs(speech_replicas):
    client = speech_replicas
    pids = [s.pid for s in client.replica_status(0)]
    assert len(set(pids)) == 2 and None not in pids
    reference = await speak(client, TEXT, "reference")
    before = [s.submitted for s in client.replica_status(0)]
    audios = await asyncio.gather(*(speak(client, TEXT, f"spread-{i}") for i in range(8)))
    per_replica = [s.submitted - b for s, b in zip(client.replica_status(0), before)]
    # Batch size 1, least-loaded: eight at once go four and four.
    assert per_replica == [4, 4]
    for audio in audios:
        assert_same_speech(audio, reference)
    sent = exported(client, "omni_engine_replica_requests_total")
    assert sent == {("0", str(i)): s.submitted for i, s in enumerate(client.replica_status(0))}
    assert exported(client, "omni_engine_replica_up") == {("0", "0"): 1.0, ("0", "1"): 1.0}
    assert not await wait_clean(client)


async def test_kill_9_of_a_replica_under_load_loses_no_request(speech_replicas):
    client = speech_replicas
    reference = await speak(client, TEXT, "kill-reference")
    stage = client.stage_contexts[0].client
    victim = stage.replicas[0]
    old_pid, old_dir, old_prefix = victim.process.pid, victim.runtime_dir, victim.shm_prefix
    retried_before = client.stage_retries()[0]
    health = HealthWatch(client)
    try:
        tasks = await load_both(client, 10)
        os.kill(old_pid, signal.SIGKILL)
        # Speech comes whole, so every request on the killed replica had no output yet:
        # each is moved to the live one and succeeds there.
        audios = await asyncio.gather(*tasks)
        for audio in audios:
            assert_same_speech(audio, reference)
        assert client.stage_retries()[0] - retried_before >= 2
        # The dead one is evicted and reaped; the stage is healthy throughout.
        assert not await wait_group_gone(old_pid)
        async with asyncio.timeout(60):
            while not (client.replica_status(0)[0].alive and stage.replicas[0] is not victim):
                await asyncio.sleep(0.05)
        new_pid = client.replica_status(0)[0].pid
        assert new_pid != old_pid and client.stage_restarts()[0] == 1
    finally:
        await health.stop()
    assert health.checks > 10 and not health.failures, health.failures[:3]
    assert not old_dir.exists() and not list_segments(old_prefix)
    # The restarted replica serves again.
    before = client.replica_status(0)[0].submitted
    audios = await asyncio.gather(*(speak(client, TEXT, f"after-{i}") for i in range(4)))
    assert client.replica_status(0)[0].submitted > before
    for audio in audios:
        assert_same_speech(audio, reference)
    assert not await wait_clean(client)


async def test_without_retry_a_dead_replica_fails_its_requests_naming_it():
    client = await MultiStageEngineClient.from_config(speech_replicas_config(retry="never"))
    try:
        stage = client.stage_contexts[0].client
        pids = [s.pid for s in client.replica_status(0)]
        tasks = await load_both(client, 8)
        os.kill(pids[0], signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and len(failed) < len(results)
        for error in failed:
            assert isinstance(error, StageDeadError) and error.replica == 0 and error.stage_id == 0
            assert "stage 0 replica 0 died" in str(error) and "runtime.retry is never" in str(error)
        # One replica lives: the stage serves and is healthy.
        await client.check_health()
        assert exported(client, "omni_engine_replica_up") == {("0", "0"): 0.0, ("0", "1"): 1.0}
        assert exported(client, "omni_engine_stage_up") == {("0",): 1.0}
        assert not client.errored and client.stage_alive(0)
        assert len(await speak(client, "Still here.", "one-left")) > 0
        # None lives: the stage is dead, naming every replica gone.
        os.kill(pids[1], signal.SIGKILL)
        async with asyncio.timeout(5):
            while not client.errored:
                await asyncio.sleep(0.02)
        with pytest.raises(StageDeadError, match="stage 0: every replica is dead"):
            await client.check_health()
        with pytest.raises(StageDeadError, match="stage 0"):
            await speak(client, "Anyone?", "none-left")
        assert stage.state_counts() == {"in_flight": 0, "held": 0, "queued": 0}
    finally:
        await client.shutdown_async()
    assert not await after_shutdown(client)


def fan_out_config():
    """Stage 0 makes ``fan_out`` sub-requests for stages 1 and 2 (two replicas each) which report
    the pid that ran them: 1 keeps a request's sub-requests together, 2 spreads them round-robin."""
    probe = {"model_factory": "tests.models:make_pid_probe"}
    sink = {"stage_type": "generation", "engine_input_source": [0], "custom_process_input_func": "tests.models:FanOut",
            "engine_args": {**probe, "delay": 0.05}, "final_output": True, "final_output_type": "tensor"}
    return parse_pipeline_config({"stage_args": [
        {"stage_id": 0, "stage_type": "generation", "engine_args": probe},
        {"stage_id": 1, **sink, "runtime": {"num_replicas": 2, "affinity": "request"}},
        {"stage_id": 2, **sink, "runtime": {"num_replicas": 2, "load_balance": "round-robin"}},
    ]}, "<fan-out test>")


async def test_affinity_keeps_sub_requests_together_and_round_robin_spreads_them():
    client = await MultiStageEngineClient.from_config(fan_out_config())

    async def ran_on(request_id: str, stage: int) -> list[tuple[int, int]]:
        got = []
        async with asyncio.timeout(30):
            async for out in client.generate({"fan_out": 6}, None, request_id, final_stage_id=stage):
                if out.multimodal_output:
                    got.append((out.multimodal_output["index"], out.multimodal_output["pid"]))
        return got

    try:
        replica_pids = {sid: {s.pid for s in client.replica_status(sid)} for sid in (1, 2)}
        for got in await asyncio.gather(ran_on("together-a", 1), ran_on("together-b", 1)):
            assert [index for index, _ in got] == list(range(6))
            (pid,) = {pid for _, pid in got}
            assert pid in replica_pids[1]
        spread = await ran_on("spread", 2)
        assert [index for index, _ in spread] == list(range(6))
        pids = [pid for _, pid in spread]
        assert set(pids) == replica_pids[2]
        assert all(a != b for a, b in zip(pids, pids[1:])), pids  # in turn
        assert not await wait_clean(client)
    finally:
        await client.shutdown_async()
    assert not await after_shutdown(client)
