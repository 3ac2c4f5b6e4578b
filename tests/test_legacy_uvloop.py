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
