"""Large tensors cross from stage to stage as shared-memory handles: the client
forwards the handle and never copies the bytes."""

from __future__ import annotations

import asyncio
import gc

import pytest

from omni_engine.config import parse_pipeline_config
from omni_engine.connectors.shm import list_segments
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient

pytestmark = pytest.mark.asyncio(loop_scope="session")

NBYTES = 8 << 20


def config(use_shm: bool):
    return parse_pipeline_config({
        "runtime": {"execution_mode": "sequential", "connectors": {"use_shm": use_shm}},
        "stage_args": [
            {"stage_id": 0, "stage_type": "generation",
             "engine_args": {"model_factory": "tests.models:make_tensor_source"}},
            {"stage_id": 1, "stage_type": "generation", "engine_input_source": [0],
             "engine_args": {"model_factory": "tests.models:make_tensor_sink"},
             "custom_process_input_func": "tests.models:ForwardTensor",
             "final_output": True, "final_output_type": "tensor"},
        ],
    }, "<tensor pipeline>")


async def run_once(client, request_id):
    outputs = [o async for o in client.generate({"nbytes": NBYTES}, None, request_id)]
    assert len(outputs) == 1 and outputs[0].finished
    return outputs[0].multimodal_output


@pytest.mark.parametrize("use_shm", [True, False])
async def test_tensor_crosses_stages_without_the_client_copying_it(use_shm):
    client = await MultiStageEngineClient.from_config(config(use_shm))
    source = client.stage_contexts[0].client
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
