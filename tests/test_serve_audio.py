"""``omni-engine serve`` on the speech pipeline: OpenAI's speech API and chat answers with audio,
used with the official client."""

from __future__ import annotations

import base64
import io
import json
import secrets
import time
import wave

import numpy as np
import openai
import pytest

from omni_engine.pipeline.input_processors import split_sentences
from tests.otlp_receiver import OtlpReceiver
from tests.serve_helpers import assert_nothing_in_flight, auth_headers, openai_client, running_server, scrape

pytestmark = [pytest.mark.llm, pytest.mark.tts]

MODEL = "smollm2-speech"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a short story about a cat."}]
API_KEY = "test-key-7f3a"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def receiver():
    """Where the server's traces go (an OTLP/HTTP collector): every test here runs traced."""
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path, receiver):
    # vLLM's serve flags, as an operator passes them to `vllm serve`.
    # Dev mode: vLLM's RL routes (weight updates) are on, behind the key like every route.
    with running_server("stage_configs/smollm2_speech.yaml", MODEL, tmp_path_factory.mktemp("serve-audio"),
                        extra_args=("--allowed-origins", f'["{ORIGIN}"]', "--enable-request-id-headers",
                                    "--otlp-traces-endpoint", receiver.url),
                        api_key=API_KEY, env={"VLLM_SERVER_DEV_MODE": "1",
                                              "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 22050)
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return samples, 22050


def assert_speech(samples: np.ndarray, rate: int, min_s: float = 0.5) -> None:
    assert len(samples) / rate > min_s
    assert float(np.sqrt(np.mean((samples / 32768.0) ** 2))) > 0.01  # not silence


def test_speech_returns_a_wav(client):
    response = client.audio.speech.create(model=MODEL, voice="en", input="Hello world.", response_format="wav")
    assert response.response.headers["content-type"].startswith("audio/wav")
    assert_speech(*read_wav(response.content))


def test_speech_pcm_is_raw_16_bit(client):
    response = client.audio.speech.create(model=MODEL, voice="en", input="Hello world.", response_format="pcm",
                                          speed=1.5)
    data = response.content
    assert len(data) % 2 == 0 and not data.startswith(b"RIFF")
    assert_speech(np.frombuffer(data, dtype="<i2"), 22050, min_s=0.3)


def test_speech_errors_are_400s_and_the_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as unknown:
        client.audio.speech.create(model=MODEL, voice="no-such-voice", input="Hello.", response_format="wav")
    assert "no-such-voice" in str(unknown.value)
    with pytest.raises(openai.BadRequestError) as empty:
        client.audio.speech.create(model=MODEL, voice="en", input="   ", response_format="wav")
    assert "input" in str(empty.value)
    with pytest.raises(openai.BadRequestError) as speed:
        client.audio.speech.create(model=MODEL, voice="en", input="Hello.", speed=9.0)
    assert "speed" in str(speed.value)
    with pytest.raises(openai.BadRequestError) as fmt:
        client.audio.speech.create(model=MODEL, voice="en", input="Hello.", response_format="vorbis")
    assert "'vorbis'" in str(fmt.value) and "mp3" in str(fmt.value)
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model="no-such-model", voice="en", input="Hello.", response_format="wav")
    response = client.audio.speech.create(model=MODEL, voice="en", input="Still here.", response_format="wav")
    assert_speech(*read_wav(response.content))


def test_chat_with_audio_returns_text_and_a_wav(client):
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
        modalities=["text", "audio"], audio={"voice": "en", "format": "wav"})
    message = response.choices[0].message
    assert "Paris" in message.content
    assert message.audio is not None and message.audio.id and message.audio.expires_at > time.time()
    assert "Paris" in message.audio.transcript
    assert_speech(*read_wav(base64.b64decode(message.audio.data)))
    assert response.usage.prompt_tokens > 0 and response.usage.completion_tokens > 0


def test_chat_without_audio_is_vllms_text_answer(client):
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    message = response.choices[0].message
    assert "Paris" in message.content and message.audio is None


def test_chat_with_an_unknown_voice_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                       modalities=["text", "audio"], audio={"voice": "no-such-voice", "format": "wav"})
    assert "no-such-voice" in str(bad.value)


def test_streaming_chat_with_audio_streams_audio_per_sentence(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=STORY, temperature=0, max_tokens=60, stream=True,
        modalities=["text", "audio"], audio={"voice": "en", "format": "pcm16"})
    text, transcript, audio_chunks, order = "", "", [], []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        audio = getattr(delta, "audio", None)
        if audio:
            transcript += getattr(audio, "transcript", None) or ""
            if getattr(audio, "data", None):
                audio_chunks.append(base64.b64decode(audio.data))
                order.append("audio")
        if delta.content:
            order.append("text")
    assert text and transcript == text
    assert len(audio_chunks) > 1, "expected one audio chunk per sentence"
    assert all(len(c) % 2 == 0 for c in audio_chunks)
    assert_speech(np.frombuffer(b"".join(audio_chunks), dtype="<i2"), 22050, min_s=1.0)
    # async_chunk: the first sentence is spoken before the text is finished.
    assert order.index("audio") < len(order) - 1 - order[::-1].index("text"), order


OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse")


def test_every_openai_voice_speaks_and_each_sounds_different(client):
    renderings = set()
    for voice in OPENAI_VOICES:
        response = client.audio.speech.create(model=MODEL, voice=voice, input="Hello world.", response_format="wav")
        samples, rate = read_wav(response.content)
        assert_speech(samples, rate, min_s=0.3)
        renderings.add(samples.tobytes())
    assert len(renderings) == len(OPENAI_VOICES)
    # An engine code with a variant works too.
    assert_speech(*read_wav(client.audio.speech.create(model=MODEL, voice="en-us+f2", input="Hello world.",
                                                       response_format="wav").content), min_s=0.3)


def test_voices_are_listed_and_an_unknown_one_points_at_the_list(server, client):
    import httpx

    listing = httpx.get(f"{server['url']}/v1/audio/voices", timeout=30, headers=auth_headers(server)).json()
    ids = [v["id"] for v in listing["data"]]
    assert set(OPENAI_VOICES) <= set(ids) and {"en", "en-gb", "en-us"} <= set(ids)
    alloy = next(v for v in listing["data"] if v["id"] == "alloy")
    assert alloy["kind"] == "openai" and alloy["engine_voice"].startswith("en")
    assert "f2" in listing["variants"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.speech.create(model=MODEL, voice="nosuchvoice", input="Hello.", response_format="wav")
    assert "nosuchvoice" in str(bad.value) and "/v1/audio/voices" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.speech.create(model=MODEL, voice="en+nosuchvariant", input="Hello.", response_format="wav")
    assert "en+nosuchvariant" in str(bad.value)


def test_chat_audio_with_an_openai_voice(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
        modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    message = completion.choices[0].message
    assert "Paris" in message.content
    assert_speech(*read_wav(base64.b64decode(message.audio.data)), min_s=0.3)


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """Back to float samples with the library that encoded it (PyAV)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        rate = stream.rate
        frames = [f.to_ndarray().astype(np.float64).reshape(-1) for f in container.decode(stream)]
    samples = np.concatenate(frames)
    if np.abs(samples).max() > 2:  # integer samples (flac)
        samples = samples / 32768.0
    return samples, rate


@pytest.mark.parametrize("fmt, rate", [("mp3", 22050), ("opus", 48000), ("aac", 22050), ("flac", 22050)])
def test_speech_in_each_openai_format(client, fmt, rate):
    reference, _ = read_wav(client.audio.speech.create(model=MODEL, voice="nova", input="Hello world.",
                                                       response_format="wav").content)
    response = client.audio.speech.create(model=MODEL, voice="nova", input="Hello world.", response_format=fmt)
    samples, got_rate = decode(response.content)
    assert got_rate == rate
    expected_s = len(reference) / 22050
    assert abs(len(samples) / got_rate - expected_s) < 0.15, (len(samples) / got_rate, expected_s)
    assert float(np.sqrt(np.mean(samples ** 2))) > 0.01


def test_speech_defaults_to_mp3_as_openai_does(server):
    import httpx

    response = httpx.post(f"{server['url']}/v1/audio/speech", timeout=60, headers=auth_headers(server),
                          json={"model": MODEL, "input": "Hello world.", "voice": "alloy"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("audio/mpeg")
    samples, rate = decode(response.content)
    assert rate == 22050 and len(samples) / rate > 0.3


@pytest.mark.parametrize("fmt", ["mp3", "flac"])
def test_chat_audio_in_compressed_formats(client, fmt):
    completion = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
        modalities=["text", "audio"], audio={"voice": "echo", "format": fmt})
    samples, rate = decode(base64.b64decode(completion.choices[0].message.audio.data))
    assert rate == 22050 and len(samples) / rate > 0.5 and float(np.sqrt(np.mean(samples ** 2))) > 0.01


SENTENCES = "The sun is warm today. The sea is calm and blue. Birds are singing in the trees."


def test_speech_streams_sentence_by_sentence_as_audio(client):
    """``stream_format: audio``: one mp3 stream, arriving in pieces (a sentence at a time)."""
    # Each sentence is spoken on its own: the stream is their renderings, back to back.
    expected_s = sum(len(read_wav(client.audio.speech.create(model=MODEL, voice="onyx", input=sentence,
                                                              response_format="wav").content)[0]) / 22050
                     for sentence in split_sentences(SENTENCES))
    chunks = []
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="onyx", input=SENTENCES, response_format="mp3", stream_format="audio") as response:
        assert response.headers["content-type"].startswith("audio/mpeg")
        for chunk in response.iter_bytes():
            chunks.append(chunk)
    assert len(chunks) > 1, "expected the audio in several pieces"
    samples, rate = decode(b"".join(chunks))
    assert rate == 22050 and abs(len(samples) / rate - expected_s) < 0.15, (len(samples) / rate, expected_s)
    assert float(np.sqrt(np.mean(samples ** 2))) > 0.01


PASSAGE = ("Once upon a time, in a quiet village by the sea, there lived a cat named Tom. "
           "He liked fish. Every morning he walked to the harbour to watch the boats come in.")


def envelope(samples: np.ndarray, rate: int, window_s: float = 0.05) -> np.ndarray:
    """RMS per window: the shape of the speech, blind to a few samples' shift."""
    n = int(rate * window_s)
    frames = samples[: len(samples) // n * n].reshape(-1, n)
    return np.sqrt((frames ** 2).mean(axis=1))


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "aac"])
def test_speech_streams_as_it_is_spoken_in_every_format(server, fmt):
    """Without ``stream_format`` (as OpenAI's clients ask), every format streams a piece at a time
    (chunked transfer: the passage's first clause, then its sentences) and decodes to the passage:
    as long as the raw pcm answer, with its shape. (eSpeak varies a few samples per synthesis;
    that the stream is byte for byte the file made at once is test_audio_formats' to show.)"""
    import httpx

    from omni_engine.pipeline.input_processors import split_for_speech

    assert len(split_for_speech(PASSAGE)) == 4
    url, headers = f"{server['url']}/v1/audio/speech", auth_headers(server)
    pcm = httpx.post(url, json={"model": MODEL, "input": PASSAGE, "voice": "en", "response_format": "pcm"},
                     headers=headers, timeout=60)
    assert pcm.headers["x-sample-rate"] == "22050" and "content-length" not in pcm.headers
    reference = np.frombuffer(pcm.content, dtype="<i2") / 32768.0
    with httpx.stream("POST", url, json={"model": MODEL, "input": PASSAGE, "voice": "en", "response_format": fmt},
                      headers=headers, timeout=60) as response:
        assert response.status_code == 200 and response.headers["transfer-encoding"] == "chunked"
        chunks = list(response.iter_bytes())
    assert len(chunks) >= 2, "the answer came in one piece"
    samples, rate = decode(b"".join(chunks))
    assert rate == (48000 if fmt == "opus" else 22050)
    # Codec priming and padding (mp3, aac, opus) and eSpeak's own variation: well under 0.1 s.
    assert abs(len(samples) / rate - len(reference) / 22050) < 0.1, (len(samples) / rate, len(reference) / 22050)
    want = envelope(reference, 22050)

    def likeness(shift: int) -> float:  # lossy codecs put their priming samples in front
        got = envelope(samples[shift:], rate)
        n = min(len(got), len(want))
        return float(np.corrcoef(got[:n], want[:n])[0, 1])

    assert max(likeness(shift) for shift in range(0, rate // 10, rate // 400)) > 0.95


def test_a_listener_that_hangs_up_mid_speech_leaves_nothing_in_flight(server):
    """Closing the connection after the first audio aborts every piece not yet spoken, on every stage."""
    import httpx

    from omni_engine.pipeline.input_processors import split_for_speech

    def speech_stage(counter: str) -> float:
        return sum(v for labels, v in scrape(server["url"]).get(f"omni_engine_stage_requests_{counter}_total", [])
                   if labels.get("stage") == "1")

    url, headers = f"{server['url']}/v1/audio/speech", auth_headers(server)
    long_passage = " ".join([PASSAGE] * 6)
    pieces = len(split_for_speech(long_passage))  # 19: most are still queued when the listener leaves
    finished, aborted = speech_stage("finished"), speech_stage("aborted")
    with httpx.stream("POST", url, json={"model": MODEL, "input": long_passage, "voice": "en",
                                         "response_format": "pcm"}, headers=headers, timeout=60) as response:
        first = next(response.iter_bytes())
    assert len(first) > 1000
    assert_nothing_in_flight(server)
    # The pieces nobody would hear were aborted, not spoken to the end (eSpeak speaks one in ~50 ms;
    # the hang-up is noticed within milliseconds. Measured: 1 spoken after the first, 18 aborted).
    spoken, dropped = speech_stage("finished") - finished, speech_stage("aborted") - aborted
    assert spoken + dropped == pieces and spoken <= pieces // 2, (spoken, dropped)
    again = httpx.post(url, json={"model": MODEL, "input": "Still here.", "voice": "en", "response_format": "wav"},
                       headers=headers, timeout=60)
    assert again.status_code == 200 and len(read_wav(again.content)[0]) > 5000


def test_speech_streams_as_sse_events(client):
    """``stream_format: sse``: speech.audio.delta events with base64 audio, then speech.audio.done."""
    import json

    events = []
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="coral", input=SENTENCES, response_format="pcm", stream_format="sse") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) == 3 and events[-1]["type"] == "speech.audio.done"  # one per sentence
    assert events[-1]["usage"]["input_tokens"] > 0
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert_speech(np.frombuffer(pcm, dtype="<i2"), 22050, min_s=2.0)
    with pytest.raises(openai.BadRequestError, match="stream_format"):
        client.audio.speech.create(model=MODEL, voice="en", input="Hi.", stream_format="chunks")


# Every route that reaches the model, vLLM's and ours: (method, path, JSON body).
GUARDED_ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 4}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4}),
    ("POST", "/v1/audio/speech", {"model": MODEL, "input": "Hello.", "voice": "alloy"}),
    ("GET", "/v1/audio/voices", None),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "Hello"}),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2]}),
    ("POST", "/invocations", {"model": MODEL, "prompt": "Hello", "max_tokens": 4}),
]


def test_the_api_key_is_required_on_every_route(server):
    """``--api-key`` as in ``vllm serve``, and on every route (vLLM leaves /tokenize, /invocations
    ... open): 401 without the key or with a wrong one; the probes and /metrics stay open."""
    import httpx

    url = server["url"]
    for method, path, body in GUARDED_ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
            response = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers, response.status_code, response.text[:200])
        response = httpx.request(method, url + path, json=body, headers=auth_headers(server), timeout=60)
        assert response.status_code == 200, (path, response.status_code, response.text[:300])
    for path in ("/health", "/ping", "/metrics", "/version"):
        assert httpx.get(url + path, timeout=30).status_code == 200, path
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", timeout=30, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.audio.speech.create(model=MODEL, voice="alloy", input="Hello.")


def test_vllm_cors_and_request_id_flags_behave_as_in_vllm_serve(server):
    import httpx

    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(f"{server['url']}/v1/audio/speech", headers={"Origin": ORIGIN, **preflight}, timeout=30)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{server['url']}/v1/audio/speech", timeout=30,
                          headers={"Origin": "https://elsewhere.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    response = httpx.get(f"{server['url']}/v1/audio/voices", timeout=30,
                         headers={**auth_headers(server), "X-Request-Id": "trace-42"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-42"


RL_ROUTES = [
    ("POST", "/pause", None), ("POST", "/resume", None), ("GET", "/is_paused", None),
    ("POST", "/init_weight_transfer_engine", {"init_info": {}}), ("POST", "/start_weight_update", None),
    ("POST", "/update_weights", {"update_info": {}}), ("POST", "/finish_weight_update", None),
    ("POST", "/update_weight_version", {"new_version": "99"}), ("GET", "/weight_info", None),
    ("POST", "/weight_checker", {"action": "checksum"}), ("POST", "/reset_prefix_cache", None),
    ("POST", "/collective_rpc", {"method": "get_model"}), ("POST", "/sleep", None), ("POST", "/wake_up", None),
    ("GET", "/is_sleeping", None),
]


def test_weight_updates_through_the_rl_routes_with_a_trainer_script(server, smollm2_path, tmp_path):
    """The speech pipeline under ``VLLM_SERVER_DEV_MODE=1``: every RL route needs the key; a trainer
    process pushes over HTTP + shm with the fence; answers and their weight_version follow; bad calls
    are 4xx with a message and change nothing."""
    import httpx

    from tests.test_serve_weights import check_row_swap_push

    url = server["url"]
    for method, path, body in RL_ROUTES:
        response = httpx.request(method, url + path, json=body, timeout=30)
        assert response.status_code == 401, (path, response.status_code)
    headers = auth_headers(server)
    version = httpx.get(f"{url}/weight_info", headers=headers, timeout=30).json()["weight_version"]
    assert httpx.get(f"{url}/is_paused", headers=headers, timeout=30).json() == {"is_paused": False}
    refused = [
        ("POST", "/update_weights", {"update_info": {"names": []}}, "update_weights without start_weight_update"),
        ("POST", "/finish_weight_update", None, "finish_weight_update without start_weight_update"),
        ("POST", "/update_weight_version", {"new_version": version}, "is the version the pipeline is on already"),
    ]
    for method, path, body, message in refused:
        response = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
        assert 400 <= response.status_code < 500 and message in response.text, (path, response.text[:300])
    response = httpx.post(f"{url}/pause", params={"mode": "sometimes"}, headers=headers, timeout=30)
    assert 400 <= response.status_code < 500
    checksums = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}, headers=headers, timeout=60)
    assert checksums.status_code == 200 and all(k.startswith("s0.r0.") for k in checksums.json()["checksums"])
    assert httpx.get(f"{url}/is_sleeping", headers=headers, timeout=30).json() == {"is_sleeping": False}
    check_row_swap_push({**server, "model": MODEL}, smollm2_path, tmp_path, "--mode", "wait")


def test_the_speech_pipelines_stages_start_before_the_server_imports_vllm(server):
    """Its config names edge input processors: checking them imports no vLLM either."""
    log = server["log"].read_text(errors="replace")
    assert "2 stage(s) started; this process imports vLLM meanwhile" in log, log[-3000:]


# ------------------------------------------------------------------ omni-engine bench serve


def bench(server, backend: str, *extra: str, result_dir=None) -> dict:
    """``omni-engine bench serve`` as a user runs it, against this server; its saved JSON."""
    import subprocess
    import sys

    args = [sys.executable, "-m", "omni_engine.entrypoints.cli.main", "bench", "serve", "--backend", backend,
            "--base-url", server["url"], "--api-key", API_KEY, "--voice", "en", "--disable-tqdm",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{backend}.json", *extra]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Serving Benchmark Result" in done.stdout
    plot = (result_dir / f"{backend}.png").read_bytes()  # the run's picture, beside its JSON
    assert plot.startswith(b"\x89PNG") and len(plot) > 10_000
    return json.loads((result_dir / f"{backend}.json").read_text())


VLLM_KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
             "mean_e2el_ms")
AUDIO_KEYS = ("total_audio_s", "audio_throughput", "mean_ttfa_ms", "p99_ttfa_ms", "mean_rtf", "underruns",
              "underrun_ms", "streams_with_underruns")


def streamed_speech_seconds(server, text: str) -> float:
    """The same streamed request the bench sends, decoded here by FFmpeg (PyAV): its audio seconds."""
    import av
    import httpx

    body = {"model": MODEL, "input": text, "voice": "en", "response_format": "wav", "stream_format": "audio"}
    data = httpx.post(f"{server['url']}/v1/audio/speech", json=body, headers=auth_headers(server), timeout=60).content
    with av.open(io.BytesIO(data)) as container:
        frames = [frame for frame in container.decode(audio=0)]
    return sum(f.samples for f in frames) / frames[0].sample_rate


def test_bench_speech_counts_the_audio_the_server_sends(server, client, tmp_path):
    """Speech streamed as WAV bytes: the bench's audio seconds are those of the same streamed answer
    decoded independently (the voice is deterministic), per stream; first audio before the end."""
    prompts = tmp_path / "lines.jsonl"
    text = "The cat sat by the window. It watched the rain fall on the garden."
    prompts.write_text(json.dumps({"prompt": text}) + "\n")
    result = bench(server, "openai-speech", "--dataset-name", "custom", "--dataset-path", str(prompts),
                   "--num-prompts", "3", "--max-concurrency", "2", "--save-detailed", result_dir=tmp_path)
    assert all(key in result for key in (*VLLM_KEYS, *AUDIO_KEYS))
    assert (result["completed"], result["failed"], result["model_id"]) == (3, 0, MODEL)
    seconds = streamed_speech_seconds(server, text)
    assert seconds > 2.0 and result["total_audio_s"] == pytest.approx(3 * seconds, rel=0.01)
    assert 0 < result["mean_ttfa_ms"] <= result["mean_e2el_ms"]
    assert result["mean_rtf"] == pytest.approx(result["mean_e2el_ms"] / 1000 / seconds, rel=0.05)
    # --save-detailed: each request's figures, which the summary's are made of.
    assert len(result["ttfas"]) == len(result["e2els"]) == len(result["underrun_ms_per_stream"]) == 3
    assert 1000 * float(np.mean(result["ttfas"])) == pytest.approx(result["mean_ttfa_ms"])
    assert sum(result["underrun_ms_per_stream"]) == pytest.approx(result["underrun_ms"])


def test_bench_chat_audio_and_text_against_the_same_answers(server, client, tmp_path):
    """Chat with audio out, greedy: the bench's audio is what a non-streamed request of the same
    prompt returns; its tokens are the server's count. Text only: vLLM's figures."""
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is the capital of France?", "max_tokens": 24}) + "\n")
    result = bench(server, "openai-chat-audio", "--dataset-name", "custom", "--dataset-path", str(prompts),
                   "--num-prompts", "2", "--max-concurrency", "1", result_dir=tmp_path)
    assert (result["completed"], result["failed"]) == (2, 0)
    reference = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24,
        temperature=0.0, modalities=["text", "audio"], audio={"voice": "en", "format": "wav"})
    samples, rate = read_wav(base64.b64decode(reference.choices[0].message.audio.data))
    assert result["total_audio_s"] == pytest.approx(2 * len(samples) / rate, rel=0.02)
    assert result["total_output_tokens"] == 2 * reference.usage.completion_tokens
    assert 0 < result["mean_ttft_ms"] < result["mean_ttfa_ms"] < result["mean_e2el_ms"]
    text = bench(server, "openai-chat", "--num-prompts", "4", "--random-input-len", "8", "--random-output-len",
                 "16", "--ignore-eos", "--request-rate", "20", "--metric-percentiles", "50,99", result_dir=tmp_path)
    assert all(key in text for key in (*VLLM_KEYS, "p50_ttft_ms")) and not any(key in text for key in AUDIO_KEYS)
    assert "ttfts" not in text  # per-request lists only with --save-detailed
    assert (text["completed"], text["total_output_tokens"]) == (4, 4 * 16)  # ignore_eos reached the server
    assert text["mean_tpot_ms"] > 0 and text["request_rate"] == 20.0


# ----------------------------------------------------------------------------- traces
def traceparent() -> tuple[str, str, dict[str, str]]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01"}


def test_a_served_chat_with_audio_is_one_trace_with_vllms_span_under_the_llm_stage(client, receiver):
    trace_id, caller_span, headers = traceparent()
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=32, extra_headers=headers,
        modalities=["text", "audio"], audio={"voice": "en", "format": "wav"})
    samples, rate = read_wav(base64.b64decode(response.choices[0].message.audio.data))
    spans = receiver.wait_for(trace_id, lambda s: any(x.name == "llm_request" for x in s) and len(s) >= 4)
    root = next(s for s in spans if s.name == "omni_request")
    assert root.parent_span_id == caller_span and root.attributes["omni.request.outcome"] == "finished"
    stages = {s.attributes["omni.stage.id"]: s for s in spans if s.name.startswith("omni_stage ")}
    assert set(stages) == {0, 1} and all(s.parent_span_id == root.span_id for s in stages.values())
    llm, voice = stages[0], stages[1]
    assert llm.attributes["omni.stage.type"] == "llm" and voice.name == "omni_stage espeak_tts"
    assert llm.attributes["gen_ai.usage.completion_tokens"] == response.usage.completion_tokens
    assert llm.attributes["gen_ai.latency.time_in_queue"] >= 0  # vLLM's scheduler's, from the stage
    # One speech sub-request per sentence; their audio is what the WAV holds.
    assert voice.attributes["omni.stage.sub_requests"] >= 1
    assert voice.attributes["omni.stage.audio_seconds"] == pytest.approx(len(samples) / rate, abs=0.01)
    # vLLM's own request span, exported by the llm stage's vLLM, is a child of that stage's span.
    vllm_span = next(s for s in spans if s.name == "llm_request")
    assert vllm_span.parent_span_id == llm.span_id
    assert vllm_span.attributes["gen_ai.usage.completion_tokens"] == response.usage.completion_tokens


def test_our_routes_continue_the_callers_trace_too(client, receiver):
    trace_id, caller_span, headers = traceparent()
    response = client.audio.speech.create(model=MODEL, voice="en", input="Hello world. Bye now.",
                                          response_format="wav", extra_headers=headers)
    samples, rate = read_wav(response.content)
    # One pipeline request per piece of the passage (its two sentences), each under the caller's span.
    spans = receiver.wait_for(trace_id, lambda s: len(s) >= 4)
    roots = {s.span_id: s for s in spans if s.name == "omni_request"}
    assert len(roots) == 2 and all(root.parent_span_id == caller_span for root in roots.values())
    voices = [s for s in spans if s.name.startswith("omni_stage ")]  # the speech route skips the llm
    assert len(voices) == 2 and {v.parent_span_id for v in voices} == set(roots)
    assert all(v.attributes["omni.stage.id"] == 1 for v in voices)
    assert sum(v.attributes["omni.stage.audio_seconds"] for v in voices) == pytest.approx(len(samples) / rate,
                                                                                          abs=0.01)
