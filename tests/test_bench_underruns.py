"""``omni-engine bench serve``'s listener against a real server whose voice stalls on purpose: a
sentence that comes 2 s late after 0.5 s of audio is exactly one underrun of about 1.5 s; the same
passage without the stall, none. On the same server, ``/v1/audio/speech`` sends a passage's first
audio while a later piece is still being made, and gives each piece its own playback deadline."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from omni_engine.bench.serve_bench import add_arguments, run_benchmark
from omni_engine.pipeline.input_processors import split_for_speech
from tests.serve_helpers import auth_headers, running_server, scrape, value

pytestmark = pytest.mark.llm

REPO = Path(__file__).resolve().parents[1]
MODEL = "stalling-voice"
SENTENCE_S, STALL_S = 0.5, 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """smollm2_speech.yaml with a voice that speaks every sentence as SENTENCE_S of tone, one at a time,
    and a sentence with STALL in it STALL_S late."""
    folder = tmp_path_factory.mktemp("stall")
    config = yaml.safe_load((REPO / "stage_configs" / "smollm2_speech.yaml").read_text())
    voice = config["stage_args"][1]
    voice["engine_args"] = {"model_factory": "tests.models:make_stalling_voice", "seconds": SENTENCE_S,
                            "stall_s": STALL_S}
    voice["runtime"]["max_batch_size"] = 1  # the stalled sentence holds back only those after it
    voice["default_sampling_params"] = {}
    path = folder / "stalling.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_server(str(path), MODEL, folder) as srv:
        yield srv


def bench_args(server, dataset: Path, num: int, concurrency: int):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--backend", "openai-speech", "--base-url", server["url"], "--dataset-name", "custom",
                              "--dataset-path", str(dataset), "--num-prompts", str(num), "--max-concurrency",
                              str(concurrency), "--disable-tqdm"])


def test_a_stall_mid_stream_is_exactly_the_underrun_the_listener_hears(server, tmp_path):
    dataset = tmp_path / "stall.jsonl"
    dataset.write_text(json.dumps({"prompt": "The first sentence is here. STALL comes next. Then a third one."}))
    result = asyncio.run(run_benchmark(bench_args(server, dataset, 2, 1)))
    assert (result["completed"], result["failed"]) == (2, 0), result["errors"]
    assert result["total_audio_s"] == pytest.approx(2 * 3 * SENTENCE_S, rel=0.02)
    # Per stream: 0.5 s heard, then silence until the stalled sentence comes 2 s after the first.
    assert result["underruns"] == 2 and result["streams_with_underruns"] == 2
    assert result["underrun_ms"] == pytest.approx(2 * 1000 * (STALL_S - SENTENCE_S), abs=2 * 300)


def test_a_stream_that_keeps_up_has_no_underrun(server, tmp_path):
    dataset = tmp_path / "smooth.jsonl"
    dataset.write_text(json.dumps({"prompt": "The first sentence is here. A second comes next. Then a third one."}))
    result = asyncio.run(run_benchmark(bench_args(server, dataset, 2, 1)))
    assert (result["completed"], result["total_audio_s"]) == (2, pytest.approx(3.0, rel=0.02))
    assert (result["underruns"], result["underrun_ms"], result["streams_with_underruns"]) == (0, 0.0, 0)
    assert result["mean_ttfa_ms"] < 1000 * STALL_S


def speech_stage(server, name: str) -> float:
    """A series of the voice's stage (stage 1, its one replica) on the server's /metrics."""
    return value(scrape(server["url"]), name, stage="1", **({"replica": "0"} if "deadline" in name else {}))


def test_the_first_audio_is_sent_while_a_later_piece_is_still_being_made(server):
    """The speech route sends a piece as soon as it and those before it exist: the first audio
    arrives while the two stalled pieces behind it (STALL_S each, one at a time) are not done."""
    import httpx

    passage = "The first sentence is here. STALL comes next. STALL comes again."
    assert len(split_for_speech(passage)) == 3
    finished = speech_stage(server, "omni_engine_stage_requests_finished_total")
    with httpx.stream("POST", f"{server['url']}/v1/audio/speech", headers=auth_headers(server), timeout=60,
                      json={"model": MODEL, "input": passage, "voice": "en", "response_format": "pcm"}) as response:
        assert response.status_code == 200, response.read()
        first = next(response.iter_bytes())
        done_by_then = speech_stage(server, "omni_engine_stage_requests_finished_total") - finished
    assert len(first) >= 2 * 1000, len(first)  # 16-bit samples of the first sentence's tone
    assert done_by_then < 3, "the first audio was held back until every piece of the passage was spoken"


def test_each_piece_of_a_speech_answer_is_due_when_the_audio_before_it_has_played(server):
    """Piece 0 is due the moment it is asked for (done after it: late, as every first piece is);
    each later one when the audio before it has played at 1x. The voice makes each at once, so on
    this idle server only the first is late: one late piece per answer, not one per piece."""
    import httpx

    passage = "The first sentence is here. A second comes next. Then a third one. And a fourth to end."
    pieces = len(split_for_speech(passage))
    assert pieces == 4
    served = speech_stage(server, "omni_engine_stage_deadline_served_total")
    late = speech_stage(server, "omni_engine_stage_deadline_late_total")
    answer = httpx.post(f"{server['url']}/v1/audio/speech", headers=auth_headers(server), timeout=60,
                        json={"model": MODEL, "input": passage, "voice": "en", "response_format": "pcm"})
    assert answer.status_code == 200 and len(answer.content) == pieces * 2 * int(SENTENCE_S * 16000)
    assert speech_stage(server, "omni_engine_stage_deadline_served_total") - served == pieces
    assert speech_stage(server, "omni_engine_stage_deadline_late_total") - late == 1, (
        "more than the first piece was due at once: every piece got the first one's deadline?")
    assert speech_stage(server, "omni_engine_stage_deadline_max_lateness_seconds") > 0
