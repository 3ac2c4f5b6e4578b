"""The orchestrator hands a request's listener clock to the edges that pace by it (``FollowsPlayback``,
as Qwen3-Omni's talker -> code2wav edge does, ``listener_pacing``), and the clock records when each
piece of speech reached the caller: what the pacer judges by. Generation stages only (they start in
well under a second); the pacing itself is simulated against a 1x listener in ``test_codec_chunks``."""

from __future__ import annotations

import pytest

from omni_engine.config import parse_pipeline_config
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from tests.models import ClockedSentence

pytestmark = pytest.mark.asyncio(loop_scope="session")
SECONDS = 0.5


async def test_a_request_that_ends_in_speech_hands_its_clock_to_the_edge_and_the_clock_hears_each_piece():
    config = parse_pipeline_config({"runtime": {"execution_mode": "async_chunk"}, "stage_args": [
        {"stage_id": 0, "stage_type": "generation", "engine_args": {"model_factory": "tests.models:make_calc",
                                                                    "op": "add1"}},
        {"stage_id": 1, "stage_type": "generation", "engine_input_source": [0],
         "custom_process_input_func": "tests.models:ClockedSentence", "final_output": True,
         "final_output_type": "audio",
         "engine_args": {"model_factory": "tests.models:make_stalling_voice", "seconds": SECONDS}},
    ]}, "<paced>")
    async with await MultiStageEngineClient.from_config(config) as client:
        outputs = [o async for o in client.generate({"values": [1], "tag": "spoken"}, None, "spoken")]
        assert [o.stage_id for o in outputs if o.finished] == [1]
        clock = ClockedSentence.clocks.pop("spoken")
        assert clock.arrived_at(0) is not None and clock.first_audio_at == clock.arrived_at(0)
        assert clock.heard_seconds(0) == pytest.approx(SECONDS)
        assert clock.arrived_at(1) is None
        # A request that ends before the speaking stage has no listener: no edge into it, no clock.
        [o async for o in client.generate({"values": [1], "tag": "silent"}, None, "silent", final_stage_id=0)]
        assert "silent" not in ClockedSentence.clocks
        assert client.orchestrator.num_requests == 0
