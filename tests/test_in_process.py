"""In-process stages (``runtime.process: false``): the stage runs in a thread of the client's
process over ``inproc://``, with the framing, abort, failure and shutdown of a stage process."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

from omni_engine.config import parse_pipeline_config
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.errors import StageDeadError, StageRequestError
from omni_engine.stage_engine.in_process import InProcessStageClient
from tests.helpers import TTS_FACTORY
from tests.stress.checks import wait_clean

pytestmark = [pytest.mark.asyncio(loop_scope="session")]

TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day by the river."


def stage_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("-in-process") or t.name.startswith("stage-")]


async def test_a_speech_stage_in_process_speaks_aborts_and_leaves_nothing():
    config = parse_pipeline_config({"stage_args": [{
        "stage_id": 0, "stage_type": "generation", "engine_args": {"model_factory": TTS_FACTORY},
        "runtime": {"process": False, "max_batch_size": 2}, "final_output": True, "final_output_type": "audio",
    }]}, "<in-process test>")
    before = stage_threads()
    client = await MultiStageEngineClient.from_config(config)
    try:
        stage = client.stage_contexts[0].client.replicas[0]
        assert isinstance(stage, InProcessStageClient) and stage.process is None
        assert client.replica_status(0)[0].pid == os.getpid()  # READY came from this process
        assert stage.input_address.startswith("inproc://") and stage.thread.is_alive()
        outs = [o async for o in client.generate(TEXT, None, "speak")]
        audio = np.concatenate([o.multimodal_output["audio"] for o in outs if o.multimodal_output])
        assert outs[-1].finished and len(audio) > 22050  # over a second of speech at 22,050 Hz
        assert outs[-1].multimodal_output["sample_rate"] == 22050
        # Concurrent requests, one left early and one aborted: the rest complete.
        long_text = " ".join([TEXT] * 40)
        gens = [client.generate(long_text, None, f"many-{i}") for i in range(4)]
        first = [asyncio.ensure_future(g.__anext__()) for g in gens[:2]]
        aborted = asyncio.ensure_future(anext(client.generate(long_text, None, "aborted")))
        await asyncio.sleep(0.05)
        await client.abort("aborted")
        async with asyncio.timeout(10):
            final = await aborted
        assert final.finished and final.request_id == "aborted"
        for task in first:
            await task
        await gens[0].aclose()  # leaving early aborts it in the stage
        for gen in gens[1:]:
            async for _ in gen:
                pass
        assert not await wait_clean(client)
    finally:
        await client.shutdown_async()
    assert not stage.thread.is_alive()
    assert stage_threads() == before


async def test_an_in_process_stage_that_dies_fails_its_requests_naming_it():
    config = parse_pipeline_config({"stage_args": [{
        "stage_id": 0, "stage_type": "generation", "engine_args": {"model_factory": "tests.models:make_fatal"},
        "runtime": {"process": False}, "final_output": True, "final_output_type": "tensor",
    }]}, "<in-process fatal>")
    client = await MultiStageEngineClient.from_config(config)
    try:
        # The request fails with the engine's error; the stage then dies of it (a fatal engine error).
        with pytest.raises(StageRequestError, match="stage 0: request 'fatal' failed: device lost"):
            async with asyncio.timeout(10):
                async for _ in client.generate({"x": 1}, None, "fatal"):
                    pass
        stage = client.stage_contexts[0].client.replicas[0]
        async with asyncio.timeout(10):
            while stage.thread.is_alive():
                await asyncio.sleep(0.02)
        with pytest.raises(StageDeadError, match="stage 0: StageEngineError: device lost"):
            await client.check_health()
        with pytest.raises(StageDeadError, match="stage 0"):
            await anext(client.generate({"x": 1}, None, "after"))
    finally:
        await client.shutdown_async()
