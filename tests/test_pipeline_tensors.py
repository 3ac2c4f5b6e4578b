"""Large tensors cross from stage to stage as shared-memory handles: the client
forwards the handle and never copies the bytes."""

from __future__ import annotations

import asyncio
import gc

import pytest

from omni_engine.connectors.shm import list_segments
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from tests.helpers import tensor_pipeline_config

pytestmark = pytest.mark.asyncio(loop_scope="session")

NBYTES = 8 << 20


async def run_once(client, request_id):
    outputs = [o async for o in client.generate({"nbytes": NBYTES}, None, request_id)]
    assert len(outputs) == 1 and outputs[0].finished
    return outputs[0].multimodal_output


@pytest.mark.parametrize("use_shm", [True, False])
async def test_tensor_crosses_stages_without_the_client_copying_it(use_shm):
    client = await MultiStageEngineClient.from_config(tensor_pipeline_config(use_shm))
    source = client.stage_contexts[0].client.replicas[0]
    try:
        result = await run_once(client, "t0")
        assert result["nbytes"] == NBYTES and result["all_same"] and result["first"] == NBYTES % 251
        sent_to_sink = client.metrics.stage(1).bytes_in
        if use_shm:
            # The sink read the source's own slot; only a handle crossed.
            assert result["segment"].startswith(source.shm_prefix + "_")
            assert sent_to_sink < 4096, sent_to_sink
        else:
            assert result["segment"] == ""
            assert sent_to_sink > NBYTES  # the bytes themselves travelled as a frame
        assert client.metrics.stage(0).bytes_out >= NBYTES
        # Slots go back to the source's pool once the request is over; the
        # next request reuses them instead of creating segments.
        gc.collect()
        async with asyncio.timeout(10):
            while (await source.call_utility_async("shm_stats"))["leased"]:
                await asyncio.sleep(0.05)
        segments = len(list_segments(source.shm_prefix))
        await run_once(client, "t1")
        assert len(list_segments(source.shm_prefix)) == segments
    finally:
        await client.shutdown_async()
    assert not list_segments(source.shm_prefix)


async def test_an_output_written_into_shared_memory_is_sent_without_a_copy():
    """``empty_output``: the model writes into a slot of its stage's pool; the
    slot itself goes to the sink, and comes back after the request. A slot
    whose output is never sent (the request failed) comes back too."""
    client = await MultiStageEngineClient.from_config(tensor_pipeline_config())
    source = client.stage_contexts[0].client.replicas[0]
    try:
        outputs = [o async for o in client.generate({"nbytes": NBYTES, "into_slot": True}, None, "slot")]
        result = outputs[-1].multimodal_output
        assert result["nbytes"] == NBYTES and result["all_same"] and result["first"] == NBYTES % 251
        assert result["segment"].startswith(source.shm_prefix + "_")
        del outputs, result
        gc.collect()
        async with asyncio.timeout(10):
            while (await source.call_utility_async("shm_stats"))["leased"]:
                await asyncio.sleep(0.05)
        with pytest.raises(Exception, match="failed after writing its output"):
            async for _ in client.generate({"nbytes": NBYTES, "into_slot": True, "fail": True}, None, "fails"):
                pass
        async with asyncio.timeout(10):
            while (await source.call_utility_async("shm_stats"))["leased"]:
                await asyncio.sleep(0.05)
        assert len(list_segments(source.shm_prefix)) == 1  # one slot, reused
    finally:
        await client.shutdown_async()
    assert not list_segments(source.shm_prefix)


async def test_an_abort_reaches_a_downstream_stage_that_is_still_working():
    """Stage 0 is done; stage 1 holds the request (its sink waits 60 s). The abort must reach
    stage 1's process, not only the stage the request started in: it lets go at once, the
    stage counts the abort, and no stage, nor the orchestrator, holds anything of it."""
    client = await MultiStageEngineClient.from_config(tensor_pipeline_config())
    sink = client.stage_contexts[1].client.replicas[0]
    try:
        stream = client.generate({"nbytes": 1024, "sink_delay": 60}, None, "held")
        outputs = asyncio.create_task(_collect(stream))
        async with asyncio.timeout(30):
            while not (client.metrics.stage(0).finished == 1
                       and await sink.call_utility_async("num_unfinished_requests") == 1):
                await asyncio.sleep(0.05)
        await client.abort("held")
        async with asyncio.timeout(10):  # not the sink's 60 s
            finals = [o for o in await outputs if o.finished]
            while await sink.call_utility_async("num_unfinished_requests"):
                await asyncio.sleep(0.05)
        assert [o.stage_id for o in finals] == [1]
        assert client.metrics.stage(1).aborted == 1
        counts = client.orchestrator.state_counts()
        assert counts["requests"] == 0 and counts["routes"] == 0, counts
        for ctx in client.stage_contexts:
            assert ctx.client.num_unfinished_requests() == 0
        assert (await run_once(client, "after"))["nbytes"] == NBYTES  # and the pipeline still serves
    finally:
        await client.shutdown_async()


async def _collect(stream) -> list:
    return [o async for o in stream]
