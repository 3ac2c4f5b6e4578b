"""``runtime.restart: on-failure``: a stage killed with SIGKILL fails the
requests in flight through it, comes back, and serves the next ones; past
``max_restarts`` it stays down and says so. On both architectures."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from omni_engine.config import parse_pipeline_config
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.errors import StageDeadError
from omni_engine.legacy import start_legacy_pipeline
from tests.helpers import TTS_FACTORY, speak, wait_group_gone, wait_healthy

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.tts]

LONG_TEXT = " ".join(["The quick brown fox jumps over the lazy dog near the quiet river bank."] * 300)


def speech_only_config(max_restarts: int):
    return parse_pipeline_config({"stage_args": [{
        "stage_id": 0, "stage_type": "generation", "engine_args": {"model_factory": TTS_FACTORY},
        "runtime": {"restart": "on-failure", "max_restarts": max_restarts},
        "final_output": True, "final_output_type": "audio",
    }]}, "<restart test>")


def _exported(client, name: str) -> float:
    from omni_engine.entrypoints.openai.metrics import PipelineMetricsCollector

    for family in PipelineMetricsCollector(client).collect():
        for sample in family.samples:
            if sample.name == name and sample.labels == {"stage": "0"}:
                return sample.value
    raise AssertionError(f"{name} not exported")


def restarts_exported(client) -> float:
    return _exported(client, "omni_engine_stage_restarts_total")


def stage_up_exported(client) -> float:
    return _exported(client, "omni_engine_stage_up")


@pytest.mark.parametrize("arch", ["new", "legacy"])
async def test_a_killed_stage_is_restarted_until_the_limit(arch):
    start = MultiStageEngineClient.from_config if arch == "new" else start_legacy_pipeline
    client = await start(speech_only_config(max_restarts=1))
    try:
        assert len(await speak(client, "Hello there.", "before")) > 0
        first_pid = client.stage_contexts[0].client.process.pid
        # A request in flight when the stage is killed fails, naming the stage, within 2 s.
        task = asyncio.ensure_future(speak(client, LONG_TEXT, "in-flight"))
        async with asyncio.timeout(10):
            while client.stage_contexts[0].client.num_unfinished_requests() == 0:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert not task.done(), "the long request should still be running"
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(StageDeadError, match="stage 0") as info:
            async with asyncio.timeout(2):
                await task
        assert info.value.stage_id == 0
        # Down: health says so. Then back, in a new process, and serving.
        assert not await wait_group_gone(first_pid)
        await wait_healthy(client)
        second_pid = client.stage_contexts[0].client.process.pid
        assert second_pid != first_pid and client.supervisor.restarts[0] == 1
        assert not client.errored
        assert restarts_exported(client) == 1 and stage_up_exported(client) == 1
        assert len(await speak(client, "Back again.", "after-restart")) > 0
        assert client.orchestrator.num_requests == 0
        # Past the limit: the stage stays down; requests and health fail naming it.
        os.kill(second_pid, signal.SIGKILL)
        assert not await wait_group_gone(second_pid)
        async with asyncio.timeout(5):
            while not client.errored:
                await asyncio.sleep(0.05)
        with pytest.raises(StageDeadError, match="stage 0"):
            await client.check_health()
        with pytest.raises(StageDeadError, match="stage 0"):
            await speak(client, "Anyone?", "after-limit")
        await asyncio.sleep(1.0)  # a restart would have begun by now
        assert client.supervisor.restarts[0] == 1 and not client.supervisor.restarting(0)
    finally:
        await client.shutdown_async()


def spare_config(max_restarts: int):
    config = speech_only_config(max_restarts)
    config.stage_args[0].runtime.warm_spare = True
    return config


def process_name(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


async def wait_spare(client, other_than: set[int]) -> int:
    """The pid of the stage's warm spare, once one other than ``other_than`` waits."""
    try:
        async with asyncio.timeout(30):
            while (spare := client.supervisor.spares.get(0)) is None or spare.process.pid in other_than:
                await asyncio.sleep(0.05)
    except TimeoutError:
        listed = client.supervisor.spares.get(0)
        raise AssertionError(f"no warm spare other than {sorted(other_than)} within 30 s; listed: "
                             f"{listed.process.pid if listed else None}") from None
    return spare.process.pid


async def test_a_warm_spare_becomes_the_restarted_replica_and_a_dead_spare_means_a_cold_restart(tmp_path):
    client = await MultiStageEngineClient.from_config(spare_config(max_restarts=2))
    stage = client.stage_contexts[0].client
    try:
        first_pid = stage.replicas[0].process.pid
        spare_pid = await wait_spare(client, set())
        spare_log = client.supervisor.spares[0].process.log_path  # where the spare says what it did
        async with asyncio.timeout(60):  # it imports the stage's model module, then waits
            while not spare_log.exists() or "waiting to be taken" not in spare_log.read_text():
                await asyncio.sleep(0.1)
        assert process_name(spare_pid) == "omni-spare0" and spare_pid != first_pid
        os.kill(first_pid, signal.SIGKILL)
        await wait_healthy(client)
        # The spare is the replica now, named as the stage, serving; a new spare waits for the next death.
        assert stage.replicas[0].process.pid == spare_pid and process_name(spare_pid) == "omni-stage0"
        listed = client.supervisor.spares.get(0)
        assert listed is None or listed.process.pid != spare_pid, (
            "the spare taken for the restart is still the stage's spare: no new one would be started")
        assert len(await speak(client, "Back again.", "after-restart")) > 0
        assert "warm spare taken: serving stage 0" in spare_log.read_text()
        second_spare = await wait_spare(client, {spare_pid})
        # A spare that died waiting is not used: the next restart starts a process of its own.
        os.kill(second_spare, signal.SIGKILL)
        assert not await wait_group_gone(second_spare)
        os.kill(spare_pid, signal.SIGKILL)
        await wait_healthy(client)
        third_pid = stage.replicas[0].process.pid
        assert third_pid not in (first_pid, spare_pid, second_spare) and client.supervisor.restarts[0] == 2
        assert process_name(third_pid) == "omni-stage0"
        assert len(await speak(client, "Once more.", "after-cold-restart")) > 0
        last_spare = await wait_spare(client, {second_spare})
    finally:
        await client.shutdown_async()
    # Shut down with the pipeline: the waiting spare, its socket directory.
    assert not await wait_group_gone(last_spare) and client.supervisor.spares == {}
