"""``runtime.restart: on-failure``: a stage killed with SIGKILL fails the
requests in flight through it, comes back, and serves the next ones; past
``max_restarts`` it stays down and says so. On both architectures."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from omni_engine.config import parse_pipeline_config
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.errors import StageDeadError
from omni_engine.legacy import start_legacy_pipeline
from tests.helpers import TTS_FACTORY, speak, wait_group_gone

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.tts]

LONG_TEXT = " ".join(["The quick brown fox jumps over the lazy dog near the quiet river bank."] * 300)


def speech_only_config(max_restarts: int):
    return parse_pipeline_config({"stage_args": [{
        "stage_id": 0, "stage_type": "generation", "engine_args": {"model_factory": TTS_FACTORY},
        "runtime": {"restart": "on-failure", "max_restarts": max_restarts},
        "final_output": True, "final_output_type": "audio",
    }]}, "<restart test>")


async def wait_healthy(client, timeout: float = 90.0) -> None:
    async with asyncio.timeout(timeout):
        while True:
            try:
                await client.check_health()
                return
            except StageDeadError:
                await asyncio.sleep(0.2)


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
