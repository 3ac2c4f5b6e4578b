"""``omni-engine bench serve``'s parts that need no server: the listener, streamed WAV, datasets, figures."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave

import httpx
import numpy as np
import pytest

from omni_engine.bench.backends import (BenchSettings, RequestResult, WavStream, openai_chat, openai_chat_audio,
                                        wav_seconds)
from omni_engine.bench.datasets import BenchRequest, DatasetError, custom_requests, random_requests
from omni_engine.bench.playback import play
from omni_engine.bench.results import summarize


def test_a_stream_that_keeps_ahead_of_the_listener_has_no_underrun():
    # 1 s chunks every 0.5 s from 0.3 s: the queue only grows.
    heard = play([(0.3 + 0.5 * i, 1.0) for i in range(6)])
    assert heard.first_audio_s == 0.3 and heard.audio_s == 6.0
    assert (heard.underruns, heard.underrun_s) == (0, 0.0)
    assert heard.played_until_s == pytest.approx(6.3)


def test_each_time_the_queue_runs_dry_is_one_underrun_of_the_silence_heard():
    # 0.5 s at 1.0 (dry at 1.5), 0.5 s at 2.0 (0.5 s of silence; dry at 2.5), 1 s at 2.4 (in time,
    # dry at 3.5), 0.2 s at 4.0 (0.5 s of silence): two underruns, 1.0 s of silence.
    heard = play([(1.0, 0.5), (2.0, 0.5), (2.4, 1.0), (4.0, 0.2)])
    assert heard.underruns == 2 and heard.underrun_s == pytest.approx(1.0)
    assert heard.first_audio_s == 1.0 and heard.played_until_s == pytest.approx(4.2)


def test_empty_chunks_and_no_audio():
    assert play([(0.5, 0.0), (1.0, 0.0)]).first_audio_s is None
    heard = play([(0.5, 0.0), (1.0, 0.25)])  # a header-only chunk is not the first audio
    assert heard.first_audio_s == 1.0 and heard.underruns == 0


def wav_bytes(seconds: float, rate: int = 22050) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.zeros(int(seconds * rate), dtype="<i2").tobytes())
    return out.getvalue()


def test_a_streamed_wav_is_counted_in_seconds_whatever_its_chunks():
    data = wav_bytes(1.5, 16000)
    assert wav_seconds(data) == pytest.approx(1.5)
    for size in (7, 44, 45, 1000, len(data)):  # the header split anywhere
        stream = WavStream()
        total = sum(stream.feed(data[i:i + size]) for i in range(0, len(data), size))
        assert total == pytest.approx(1.5), size


def test_random_prompts_are_seeded_and_custom_files_are_checked(tmp_path):
    a, b = random_requests(3, 12, 20, seed=1), random_requests(3, 12, 20, seed=1)
    assert a == b and all(len(r.prompt.split()) == 12 and r.max_tokens == 20 for r in a)
    assert random_requests(3, 12, 20, seed=2) != a
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": "one two"}), "", json.dumps({"prompt": "three", "max_tokens": 5})]
    path.write_text("\n".join(lines) + "\n")
    rows = custom_requests(path, 5, 64, seed=0)
    assert len(rows) == 5 and {(r.prompt, r.max_tokens) for r in rows} == {("one two", 64), ("three", 5)}
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(DatasetError, match=r"prompts.jsonl:2: expected an object with a non-empty string 'prompt'"):
        custom_requests(path, 1, 64, seed=0)
    path.write_text("{not json\n")
    with pytest.raises(DatasetError, match=r"prompts.jsonl:1: not JSON"):
        custom_requests(path, 1, 64, seed=0)


def test_the_figures_follow_vllms_definitions():
    one = RequestResult(4, success=True, latency=2.0, ttft=0.5, itl=[0.5, 0.5, 0.5], output_tokens=4,
                        prompt_tokens=10, text="abcd", audio_chunks=[(1.0, 2.0), (3.5, 1.0)])
    two = RequestResult(4, success=True, latency=1.0, ttft=0.2, itl=[0.4, 0.4], output_tokens=3,
                        prompt_tokens=10, text="abc")
    failed = RequestResult(4, error="HTTP 503: busy")
    figures = summarize([one, two, failed], duration_s=4.0, percentiles=[50, 99])
    assert (figures["completed"], figures["failed"], figures["errors"]) == (2, 1, ["HTTP 503: busy"])
    assert figures["request_throughput"] == 0.5 and figures["output_throughput"] == 7 / 4
    assert figures["total_token_throughput"] == 27 / 4
    assert figures["mean_ttft_ms"] == pytest.approx(350) and figures["p50_ttft_ms"] == pytest.approx(350)
    # TPOT: (2.0 - 0.5) / 3 and (1.0 - 0.2) / 2
    assert figures["mean_tpot_ms"] == pytest.approx((500 + 400) / 2)
    assert figures["median_itl_ms"] == pytest.approx(500) and figures["mean_itl_ms"] == pytest.approx(460)
    # Audio from the one stream with audio: first at 1.0 s; dry at 3.0, next at 3.5: one 0.5 s underrun.
    assert figures["total_audio_s"] == 3.0 and figures["audio_throughput"] == 0.75
    assert figures["mean_ttfa_ms"] == pytest.approx(1000) and figures["mean_rtf"] == pytest.approx(2.0 / 3.0)
    assert (figures["underruns"], figures["underrun_ms"], figures["streams_with_underruns"]) == (1, 500.0, 1)
    assert "total_audio_s" not in summarize([two], 1.0, [99])


def test_speech_in_is_mixed_to_mono_and_resampled_for_the_realtime_api():
    from omni_engine.bench.backends import pcm16_mono

    stereo = io.BytesIO()
    with wave.open(stereo, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(16000)
        left = (np.sin(np.arange(16000) * 2 * np.pi * 200 / 16000) * 8000).astype("<i2")
        w.writeframes(np.stack([left, left], axis=1).tobytes())
    pcm = np.frombuffer(pcm16_mono(stereo.getvalue(), 24000), dtype="<i2")
    assert len(pcm) == 24000  # one second either way
    assert np.abs(pcm).max() == pytest.approx(8000, rel=0.01)  # the channels averaged, not summed
    with pytest.raises(ValueError, match="16-bit PCM WAV"):
        eight_bit = io.BytesIO()
        with wave.open(eight_bit, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(1)
            w.setframerate(8000)
            w.writeframes(bytes(800))
        pcm16_mono(eight_bit.getvalue(), 24000)


def _served_stream(*events: dict) -> httpx.MockTransport:
    """A server whose chat answer is 200 and these SSE events (the server under test here is the bench's
    reading of a stream, not a pipeline: a real one's mid-stream error is in tests/test_serve_metrics.py)."""
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.MockTransport(lambda request: httpx.Response(200, text=body,
                                                              headers={"content-type": "text/event-stream"}))


def _chat(backend, transport) -> RequestResult:
    async def run():
        async with httpx.AsyncClient(transport=transport) as client:
            return await backend(client, BenchSettings("http://bench", "m"), BenchRequest("hi", 1, 8))
    return asyncio.run(run())


def _delta(**delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta}]}


def test_an_error_in_a_streamed_answer_fails_the_request_with_the_servers_words():
    error = {"error": {"message": "stage 1 (speech) died", "type": "StageDeadError", "code": 500}}
    for backend in (openai_chat, openai_chat_audio):
        result = _chat(backend, _served_stream(_delta(content="Paris"), error))
        assert not result.success, backend.__name__
        assert "StageDeadError" in result.error and "stage 1 (speech) died" in result.error
    ok = _chat(openai_chat, _served_stream(_delta(content="Paris")))
    assert ok.success and ok.text == "Paris" and not ok.error


def test_a_chat_that_asked_for_audio_and_got_none_is_a_failure():
    result = _chat(openai_chat_audio, _served_stream(_delta(content="Paris")))
    assert not result.success and result.error == "the answer had no audio"
    spoken = base64.b64encode(wav_bytes(0.25, 16000)).decode()
    result = _chat(openai_chat_audio, _served_stream(_delta(content="Paris"), _delta(audio={"data": spoken})))
    assert result.success and [s for _, s in result.audio_chunks] == [pytest.approx(0.25)]


def test_a_realtime_answer_cut_at_its_max_output_tokens_counts_as_answered():
    """A session given ``max_output_tokens`` ends ``incomplete`` when the answer reaches it, as a chat
    ends with ``finish_reason: length``: answered. Cancelled, failed or cut for another reason: not."""
    from types import SimpleNamespace

    from omni_engine.bench.backends import answered

    def response(status, reason=None):
        return SimpleNamespace(status=status, status_details=SimpleNamespace(reason=reason) if reason else None)

    assert answered(response("completed"))
    assert answered(response("incomplete", "max_output_tokens"))
    assert not answered(response("incomplete", "content_filter"))
    assert not answered(response("cancelled", "turn_detected"))
    assert not answered(response("failed"))
