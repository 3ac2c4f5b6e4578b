"""Stage processes started before their client (``omni-engine serve`` starts them before it imports
vLLM): a real eSpeak stage launched, connecting before anything is bound, then adopted by its client."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from omni_engine.config import parse_pipeline_config
from omni_engine.connectors.shm import list_segments, stage_prefix
from omni_engine.pipeline.early_launch import launch_stages_early, launchable_stage_ids
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.stage_engine.stage_launch import launch_stage
from tests.helpers import TTS_FACTORY, collect, tts_spec, wait_group_gone

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_launched_stage_is_adopted_by_its_client_and_serves():
    launched = launch_stage(0, tts_spec())
    pid = launched.process.pid
    # The stage is up and connecting while nothing is bound yet: its READY waits in ZMQ.
    await asyncio.sleep(1.0)
    assert launched.process.is_alive()
    assert not os.path.exists(launched.input_address.removeprefix("ipc://"))
    client = StageEngineCoreClient(0, process=tts_spec(), launched=launched)
    try:
        await client.start()
        assert client.process.pid == pid and client.ready.pid == pid and launched.adopted
        assert client.runtime_dir == launched.runtime_dir and client.shm_prefix == stage_prefix(launched.run_prefix, 0)
        await client.submit_request("hello", "Hello there.", None)
        outputs = await collect(client, "hello")
        assert outputs[-1].finished and len(outputs[-1].multimodal_output["audio"]) > 1000
    finally:
        await client.shutdown()
    assert not await wait_group_gone(pid)
    assert not launched.runtime_dir.exists()
    assert not list_segments(client.shm_prefix)


async def test_a_launched_stage_no_client_adopts_is_stopped_by_its_clients_shutdown():
    """A pipeline whose other stage fails to start shuts every client down, started or not."""
    launched = launch_stage(3, tts_spec())
    pid = launched.process.pid
    client = StageEngineCoreClient(3, process=tts_spec(), launched=launched)
    await client.shutdown()  # never started
    assert not launched.adopted
    assert not await wait_group_gone(pid)
    assert not launched.runtime_dir.exists()


async def test_what_starts_early_and_what_starts_with_its_client():
    def config(runtime: dict, inproc: bool = True, **stage_runtime) -> object:
        stages = [{"stage_id": 0, "stage_type": "generation", "final_output": True, "final_output_type": "audio",
                   "engine_args": {"model_factory": TTS_FACTORY}, "runtime": {"process": True, **stage_runtime}}]
        if inproc:
            stages.append({"stage_id": 1, "stage_type": "generation", "final_output_type": "audio",
                           "engine_args": {"model_factory": TTS_FACTORY}, "runtime": {"process": False}})
        return parse_pipeline_config({"runtime": runtime, "stage_args": stages}, "<test>")

    assert launchable_stage_ids(config({})) == [0]  # not the in-process stage
    assert launchable_stage_ids(config({}, num_replicas=2)) == []
    assert launchable_stage_ids(config({}, transport="tcp")) == []
    assert launchable_stage_ids(config({}, inproc=False)) == [0]
    assert launchable_stage_ids(config({"security": {"curve": True}}, inproc=False, transport="tcp")) == []
    # The launch itself imports no vLLM (what it is for): in a fresh interpreter.
    probe = ("import sys; from omni_engine.config import parse_pipeline_config; "
             "from omni_engine.pipeline.early_launch import launch_stages_early, discard_launched; "
             "c = parse_pipeline_config({'stage_args': [{'stage_id': 0, 'stage_type': 'generation', "
             "'final_output': True, 'final_output_type': 'audio', 'engine_args': {'model_factory': "
             f"'{TTS_FACTORY}'}}, 'runtime': {{'devices': '0'}}}}]}}, '<probe>'); "
             "launched = launch_stages_early(c, print); discard_launched(launched); "
             "print('vllm' in sys.modules, 'torch' in sys.modules)")
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", probe, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()[-2000:]
    lines = out.decode().splitlines()
    assert lines[0].startswith("stage 0: process started (pid ") and lines[-1] == "False False", lines
    assert launch_stages_early(config({}, num_replicas=2), print) == {}
