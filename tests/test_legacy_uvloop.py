"""The legacy architecture under uvloop (what the CLI and the stress scripts run): an answer larger
than the pipe buffer arrives whole. libuv made the answer pipe non-blocking when it was polled, so
such an answer was half-read, the stage taken for dead and its requests hung."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from omni_engine.config import parse_pipeline_config
from omni_engine.legacy import start_legacy_pipeline
from tests.helpers import TTS_FACTORY

pytestmark = pytest.mark.tts

SPEECH_ONLY = parse_pipeline_config({"stage_args": [{
    "stage_id": 0, "stage_type": "generation", "engine_args": {"model_factory": TTS_FACTORY},
    "final_output": True, "final_output_type": "audio"}]}, "<speech only>")


async def speak(sentences: list[str]) -> list:
    client = await start_legacy_pipeline(SPEECH_ONLY)
    try:
        async with asyncio.timeout(30):
            return [[o async for o in client.generate(s, None, f"say-{i}")] for i, s in enumerate(sentences)]
    finally:
        await client.shutdown_async()


def test_answers_larger_than_the_pipe_buffer_arrive_whole_under_uvloop():
    sentences = ["The quick brown fox jumps over the lazy dog, again and again, all day long."] * 3
    results = uvloop.run(speak(sentences))
    for outputs in results:
        assert outputs[-1].finished
        # ~4 s of float32 audio: several times the 64 KiB pipe buffer.
        assert outputs[-1].multimodal_output["audio"].nbytes > 4 * 65536


async def abort_a_held_request() -> tuple[list, float]:
    from tests.helpers import tensor_pipeline_config
    from tests.stress.pipeline import start_pipeline

    client = await start_pipeline(tensor_pipeline_config(), legacy=True)
    try:
        async with asyncio.timeout(60):
            # The sink holds the request for 30 s: it is surely in flight when aborted.
            stream = client.generate({"nbytes": 8, "sink_delay": 30}, None, "held")
            reader = asyncio.create_task(anext(stream))
            sink = client.stage_contexts[1].client
            while sink.num_unfinished_requests() == 0:
                await asyncio.sleep(0.05)
            t0 = asyncio.get_running_loop().time()
            await client.abort("held")
            took = asyncio.get_running_loop().time() - t0
            return [await reader] + [o async for o in stream], took
    finally:
        await client.shutdown_async()


def test_abort_ends_the_stream_with_a_final_abort_output_on_the_legacy_architecture():
    """As on the new architecture (vLLM's AsyncLLM contract): the aborted stream ends with a final
    output marked "abort" (sent by the stage, not waited out), it does not raise."""
    outputs, took = uvloop.run(abort_a_held_request())
    assert len(outputs) == 1 and outputs[0].finished and outputs[0].outputs[0].finish_reason == "abort"
    from omni_engine.pipeline.orchestrator import ABORT_WAIT_S

    assert took < ABORT_WAIT_S  # the stage answered; the orchestrator did not have to make one up
