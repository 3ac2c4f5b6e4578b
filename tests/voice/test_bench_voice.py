"""``omni-engine bench serve``'s speech-in backends against the voice assistant (Whisper -> SmolLM2 ->
Piper): transcriptions streamed, realtime sessions that speak a recorded question at the pace of
speech, and Piper's speech streamed; the audio figures checked against an answer this test receives
itself."""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np
import pytest

from omni_engine.audio import wav_bytes
from omni_engine.bench.serve_bench import add_arguments, run_benchmark
from tests.realtime_helpers import aclient, answer_audio, events_until, silence, spoken, stream_audio
from tests.serve_helpers import assert_nothing_in_flight

pytestmark = [pytest.mark.llm, pytest.mark.asyncio(loop_scope="session")]

MODEL = "voice-assistant"
MAX_TOKENS = 24
# The package's server speaks with its durations' noise off (conftest.steady_voice_config): the same
# text is the same number of samples every time, so the bench's audio seconds must be the test's own.
SAME_LENGTH = 1e-9


@pytest.fixture(scope="module")
def question(tmp_path_factory):
    """A recorded question (the voice's own samples, 24 kHz) as a WAV file and its samples."""
    audio = spoken("What is the capital of France?")
    path = tmp_path_factory.mktemp("bench-voice") / "france.wav"
    path.write_bytes(wav_bytes(audio.astype(np.float32) / 32768.0, 24000))
    return path, audio


def bench_args(server, backend: str, dataset, num: int, concurrency: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--backend", backend, "--base-url", server["url"], "--api-key", server["api_key"],
                              "--dataset-name", "custom", "--dataset-path", str(dataset), "--num-prompts", str(num),
                              "--max-concurrency", str(concurrency), "--disable-tqdm"])


async def test_bench_transcription_of_files_and_of_prompts_the_server_speaks(server, question, tmp_path):
    path, _ = question
    dataset = tmp_path / "speech.jsonl"
    dataset.write_text(json.dumps({"audio": str(path)}) + "\n" + json.dumps({"prompt": "Berlin is a big city."}) + "\n")
    result = await run_benchmark(bench_args(server, "openai-transcription", dataset, 4, 2))
    assert (result["completed"], result["failed"]) == (4, 0), result["errors"]
    assert result["total_output_tokens"] >= 4 and 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert "total_audio_s" not in result  # nothing spoken back
    assert_nothing_in_flight(server)


async def test_bench_realtime_sessions_hear_the_answer_this_test_hears(server, question, tmp_path):
    path, audio = question
    dataset = tmp_path / "questions.jsonl"
    dataset.write_text(json.dumps({"audio": path.name, "max_tokens": MAX_TOKENS}) + "\n")  # relative to the file
    (tmp_path / path.name).write_bytes(path.read_bytes())
    result = await run_benchmark(bench_args(server, "openai-realtime", dataset, 4, 4))
    assert (result["completed"], result["failed"]) == (4, 0), result["errors"]
    # The same question in a session of this test's own: greedy, the same answer and the same audio.
    async with aclient(server).realtime.connect(model=MODEL) as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "max_output_tokens": MAX_TOKENS})
        await stream_audio(conn, np.concatenate([audio, silence(1.5)]))
        events = await events_until(conn, "response.done")
    seconds = len(answer_audio(events)) / 24000
    assert seconds > 0.5 and result["total_audio_s"] == pytest.approx(4 * seconds, rel=SAME_LENGTH)
    # From the end of the question: the first word, then the first audio, then the end.
    assert 0 < result["mean_ttft_ms"] < result["mean_ttfa_ms"] < result["mean_e2el_ms"]
    # Four sessions at once, each listener at 1x: no gap (the answer's pieces are served by deadline).
    assert result["streams_with_underruns"] == 0 and result["mean_rtf"] > 0, result["underrun_ms"]
    assert_nothing_in_flight(server)


async def test_bench_speech_with_the_piper_voice_counts_what_a_listener_gets(server, tmp_path):
    """``openai-speech`` against Piper (phonemizer -> voice, tensors between them): the audio seconds
    are those of the same streamed request decoded here, and each stream's figures add up."""
    import io

    import av
    import httpx

    text = "The cat sat by the window. It watched the rain fall."
    dataset = tmp_path / "lines.jsonl"
    dataset.write_text(json.dumps({"prompt": text}) + "\n")
    args = bench_args(server, "openai-speech", dataset, 3, 3)
    args.voice = None  # the server's default voice
    result = await run_benchmark(args)
    assert (result["completed"], result["failed"]) == (3, 0), result["errors"]
    body = {"model": MODEL, "input": text, "response_format": "wav", "stream_format": "audio"}
    async with httpx.AsyncClient(timeout=60) as client:
        data = (await client.post(f"{server['url']}/v1/audio/speech", json=body,
                                  headers={"Authorization": f"Bearer {server['api_key']}"})).content
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(audio=0))
    seconds = sum(f.samples for f in frames) / frames[0].sample_rate
    assert seconds > 2.0 and result["total_audio_s"] == pytest.approx(3 * seconds, rel=SAME_LENGTH)
    assert len(result["ttfas"]) == 3 and all(0 < t for t in result["ttfas"])
    assert 1000 * float(np.mean(result["ttfas"])) == pytest.approx(result["mean_ttfa_ms"])
    assert sum(result["underrun_ms_per_stream"]) == pytest.approx(result["underrun_ms"])
    assert result["mean_ttfa_ms"] < result["mean_e2el_ms"]
    assert_nothing_in_flight(server)


async def test_eight_raw_pcm_streams_at_once_play_without_a_gap(server, tmp_path):
    """8 listeners of ``/v1/audio/speech`` as raw pcm at once (what OpenAI's clients play): each hears
    its first piece early and never runs dry: the voice serves every stream's most urgent piece
    first. (A hang detector with headroom: the first piece holds ~2 s of speech, the next ones take
    the voice well under 0.1 s each; the figures under load are bench_speech_load.py's.)"""
    text = "The cat sat by the window all day. It watched the rain fall. Then it slept."
    dataset = tmp_path / "lines.jsonl"
    dataset.write_text(json.dumps({"prompt": text}) + "\n")
    args = bench_args(server, "openai-speech", dataset, 8, 8)
    args.voice, args.speech_format = None, "pcm"
    result = await run_benchmark(args)
    assert (result["completed"], result["failed"]) == (8, 0), result["errors"]
    assert result["total_audio_s"] > 8 * 3.0
    assert result["streams_with_underruns"] == 0, result["underrun_ms"]
    assert result["mean_ttfa_ms"] < result["mean_e2el_ms"]
    assert_nothing_in_flight(server)


def test_a_missing_audio_file_is_named_with_its_line(server, tmp_path):
    dataset = tmp_path / "broken.jsonl"
    dataset.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"audio": "nowhere.wav"}) + "\n")
    from omni_engine.bench.datasets import DatasetError

    with pytest.raises(DatasetError, match=r"broken.jsonl:2: audio 'nowhere.wav': No such file"):
        asyncio.run(run_benchmark(bench_args(server, "openai-realtime", dataset, 1, 1)))
