"""One request per API, timed as its answer streams in: the request functions of ``bench serve``.

Each backend sends one ``BenchRequest`` and returns a ``RequestResult``: when each piece of text
and audio arrived (seconds after the request was sent), what the server said it produced, or the
error. Text timings follow ``vllm bench serve``: time to first token is the first content chunk,
inter-token latencies the gaps between content chunks, output tokens from the stream's ``usage``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import time
import wave
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from omni_engine.bench.datasets import BenchRequest


@dataclass(slots=True)
class BenchSettings:
    """What every request of a run shares."""

    base_url: str
    model: str
    endpoint: str | None = None  # default: the backend's
    api_key: str | None = None
    voice: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0
    speech_format: str = "wav"  # openai-speech: "wav" or raw "pcm" (its rate in X-Sample-Rate)
    # Merged into every chat request's body (vllm bench serve's --extra-body), e.g. a pipeline's
    # sampling_params_list.
    extra_body: dict[str, Any] | None = None

    def url(self, default_endpoint: str) -> str:
        """The benchmarked API's URL (``--endpoint`` overrides its path)."""
        return self.api(self.endpoint or default_endpoint)

    def api(self, path: str) -> str:
        """A fixed path of the server (models, the voice that speaks prompts, the realtime base)."""
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it (times in seconds from sending it)."""

    prompt_words: int
    success: bool = False
    error: str = ""
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    audio_chunks: list[tuple[float, float]] = field(default_factory=list)  # (arrival, audio seconds)


Backend = Callable[[httpx.AsyncClient, BenchSettings, BenchRequest], Awaitable[RequestResult]]


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream (until ``[DONE]``)."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def http_error(response: httpx.Response) -> str:
    """A refused request, as the result's error: status and the start of the body."""
    body = (await response.aread()).decode(errors="replace")
    return f"HTTP {response.status_code}: {body[:300]}"


def wav_seconds(data: bytes) -> float:
    """Seconds of audio in a complete WAV file."""
    with wave.open(io.BytesIO(data)) as w:
        return w.getnframes() / w.getframerate()


class WavStream:
    """Seconds of audio in each chunk of a streamed WAV (header first, then samples; the header's
    sizes may be placeholders, as streamed WAVs have)."""

    def __init__(self) -> None:
        self._head = b""
        self._bytes_per_second: int | None = None

    def feed(self, chunk: bytes) -> float:
        if self._bytes_per_second is not None:
            return len(chunk) / self._bytes_per_second
        self._head += chunk
        data_at = self._head.find(b"data", 12)
        fmt_at = self._head.find(b"fmt ", 12)
        if data_at < 0 or fmt_at < 0 or len(self._head) < data_at + 8:
            return 0.0
        channels, rate = struct.unpack_from("<HI", self._head, fmt_at + 10)
        bits = struct.unpack_from("<H", self._head, fmt_at + 22)[0]
        self._bytes_per_second = rate * channels * bits // 8
        return (len(self._head) - data_at - 8) / self._bytes_per_second


class PcmStream:
    """Seconds of audio in each chunk of raw 16-bit mono PCM at ``rate``."""

    def __init__(self, rate: int) -> None:
        self._bytes_per_second = 2 * rate

    def feed(self, chunk: bytes) -> float:
        return len(chunk) / self._bytes_per_second


def _on_text(result: RequestResult, piece: str, now: float, last: float) -> float:
    """A piece of answer text arrived at ``now``: TTFT or one more inter-token gap."""
    if not result.text:
        result.ttft = now
    else:
        result.itl.append(now - last)
    result.text += piece
    result.output_tokens += 1  # one delta, one token: what the stream says when it sends no usage
    return now


def _chat_body(settings: BenchSettings, request: BenchRequest) -> dict[str, Any]:
    body = {"model": settings.model, "messages": [{"role": "user", "content": request.prompt}],
            "max_completion_tokens": request.max_tokens, "temperature": settings.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if settings.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **(settings.extra_body or {})}


def stream_error(event: dict[str, Any]) -> str:
    """The error a server put in its stream after the status line (vLLM's and ours: ``{"error":
    {"message", "type", "code"}}``), or "" for an ordinary event."""
    error = event.get("error")
    if not error:
        return ""
    if isinstance(error, dict):
        return f"in the stream: {error.get('type') or 'error'} {error.get('code') or ''}: {error.get('message')}"
    return f"in the stream: {error}"


async def _stream_chat(client: httpx.AsyncClient, settings: BenchSettings, request: BenchRequest,
                       body: dict[str, Any], needs_audio: bool = False) -> RequestResult:
    """A streamed chat, timed. An error event in the stream fails the request (the status line said
    200 before the answer went wrong), and so does an answer without audio when audio was asked."""
    result = RequestResult(request.prompt_words)
    start = time.perf_counter()
    last = 0.0
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", settings.url("/v1/chat/completions"), json=body,
                                 headers=settings.headers(), timeout=settings.timeout_s) as response:
            if response.status_code != 200:
                result.error = await http_error(response)
                return result
            async for event in sse_events(response):
                now = time.perf_counter() - start
                if error := stream_error(event):
                    result.error = error
                    return result
                usage = event.get("usage") or usage
                for choice in event.get("choices") or ():
                    delta = choice.get("delta") or {}
                    audio = delta.get("audio") or {}
                    if audio.get("data"):
                        result.audio_chunks.append((now, wav_seconds(base64.b64decode(audio["data"]))))
                    if delta.get("content"):
                        last = _on_text(result, delta["content"], now, last)
        if usage:  # the server's count, as vLLM's bench takes it
            result.output_tokens = usage.get("completion_tokens") or 0
            result.prompt_tokens = usage.get("prompt_tokens") or 0
        result.latency = time.perf_counter() - start
        result.success = bool(result.audio_chunks) or not needs_audio
        if not result.success:
            result.error = "the answer had no audio"
    except (httpx.HTTPError, ValueError, wave.Error) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def openai_chat(client: httpx.AsyncClient, settings: BenchSettings, request: BenchRequest) -> RequestResult:
    """``/v1/chat/completions``, streamed: text only."""
    return await _stream_chat(client, settings, request, _chat_body(settings, request))


async def openai_chat_audio(client: httpx.AsyncClient, settings: BenchSettings,
                            request: BenchRequest) -> RequestResult:
    """``/v1/chat/completions`` with ``modalities: [text, audio]``, streamed: each ``delta.audio.data``
    is a WAV of what was spoken since the last one."""
    audio = {"format": "wav", **({"voice": settings.voice} if settings.voice else {})}
    body = {**_chat_body(settings, request), "modalities": ["text", "audio"], "audio": audio}
    return await _stream_chat(client, settings, request, body, needs_audio=True)


async def openai_speech(client: httpx.AsyncClient, settings: BenchSettings, request: BenchRequest) -> RequestResult:
    """``/v1/audio/speech``, the prompt read aloud, as OpenAI's clients stream it: WAV or raw PCM
    bytes (``settings.speech_format``) timed as they arrive."""
    result = RequestResult(request.prompt_words)
    body = {"model": settings.model, "input": request.prompt, "response_format": settings.speech_format,
            **({"voice": settings.voice} if settings.voice else {})}
    start = time.perf_counter()
    stream: WavStream | PcmStream = WavStream()
    try:
        async with client.stream("POST", settings.url("/v1/audio/speech"), json=body, headers=settings.headers(),
                                 timeout=settings.timeout_s) as response:
            if response.status_code != 200:
                result.error = await http_error(response)
                return result
            if settings.speech_format == "pcm":
                rate = response.headers.get("x-sample-rate")
                if not rate:
                    result.error = "a pcm answer without an X-Sample-Rate header: its audio cannot be timed"
                    return result
                stream = PcmStream(int(rate))
            async for chunk in response.aiter_bytes():
                if seconds := stream.feed(chunk):
                    result.audio_chunks.append((time.perf_counter() - start, seconds))
        result.latency = time.perf_counter() - start
        result.success = bool(result.audio_chunks)
        if not result.success:
            result.error = "the answer had no audio"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# ----------------------------------------------------------------------------- speech in

REALTIME_RATE = 24000  # the Realtime API's pcm16
REALTIME_CHUNK_S = 0.02


async def prepare_audio(client: httpx.AsyncClient, settings: BenchSettings, requests: list[BenchRequest]) -> None:
    """Speech-in backends: a request without audio gets its prompt spoken by the server's own voice
    (``/v1/audio/speech``, before the run and not timed), once per distinct prompt."""
    made: dict[str, bytes] = {}
    for request in requests:
        if request.audio is not None:
            continue
        if request.prompt not in made:
            body = {"model": settings.model, "input": request.prompt, "response_format": "wav",
                    **({"voice": settings.voice} if settings.voice else {})}
            response = await client.post(settings.api("/v1/audio/speech"), json=body,
                                         headers=settings.headers(), timeout=settings.timeout_s)
            response.raise_for_status()
            made[request.prompt] = response.content
        request.audio = made[request.prompt]


def pcm16_mono(wav_data: bytes, rate: int) -> bytes:
    """A 16-bit PCM WAV as mono 16-bit PCM at ``rate`` (linear interpolation)."""
    import numpy as np

    with wave.open(io.BytesIO(wav_data)) as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"speech in must be 16-bit PCM WAV (got {8 * w.getsampwidth()}-bit)")
        samples = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32)
        samples = samples.reshape(-1, w.getnchannels()).mean(axis=1)
        source_rate = w.getframerate()
    if source_rate != rate:
        n = int(round(len(samples) * rate / source_rate))
        samples = np.interp(np.arange(n) * source_rate / rate, np.arange(len(samples)), samples)
    return np.clip(samples, -32768, 32767).astype("<i2").tobytes()


async def openai_transcription(client: httpx.AsyncClient, settings: BenchSettings,
                               request: BenchRequest) -> RequestResult:
    """``/v1/audio/transcriptions`` with ``stream=true``: the transcript's deltas timed as text."""
    result = RequestResult(request.prompt_words)
    start = time.perf_counter()
    last = 0.0
    try:
        async with client.stream("POST", settings.url("/v1/audio/transcriptions"), headers=settings.headers(),
                                 data={"model": settings.model, "stream": "true",
                                       "temperature": str(settings.temperature)},
                                 files={"file": ("speech.wav", request.audio or b"", "audio/wav")},
                                 timeout=settings.timeout_s) as response:
            if response.status_code != 200:
                result.error = await http_error(response)
                return result
            async for event in sse_events(response):
                if error := stream_error(event):
                    result.error = error
                    return result
                if event.get("type") == "transcript.text.delta" and event.get("delta"):
                    last = _on_text(result, event["delta"], time.perf_counter() - start, last)
        result.latency = time.perf_counter() - start
        result.success = bool(result.text.strip())
        result.error = "" if result.success else "an empty transcript"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _send_paced(conn: Any, pcm: bytes) -> None:
    """``pcm`` (16-bit, REALTIME_RATE) in 20 ms appends at the pace of speech."""
    step = int(REALTIME_RATE * REALTIME_CHUNK_S) * 2
    started = time.perf_counter()
    for n, i in enumerate(range(0, len(pcm), step)):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + step]).decode("ascii"))
        await asyncio.sleep(max(0.0, started + REALTIME_CHUNK_S * (n + 1) - time.perf_counter()))


def answered(response: Any) -> bool:
    """A realtime response that answered: completed, or cut at the ``max_output_tokens`` it was given
    (as a chat with ``max_tokens`` ends with ``finish_reason: length``)."""
    details = getattr(response, "status_details", None)
    return response.status == "completed" or (
        response.status == "incomplete" and getattr(details, "reason", None) == "max_output_tokens")


async def openai_realtime(client: httpx.AsyncClient, settings: BenchSettings, request: BenchRequest) -> RequestResult:
    """A ``/v1/realtime`` session: the question streamed at the pace of speech, then silence for the
    server's VAD; times (first word, first audio, the end) from the end of the question's speech."""
    import openai

    result = RequestResult(request.prompt_words)
    question = pcm16_mono(request.audio or b"", REALTIME_RATE)
    realtime = openai.AsyncOpenAI(base_url=settings.api("/v1"),
                                  api_key=settings.api_key or "unused", max_retries=0)
    last = 0.0
    try:
        async with realtime.realtime.connect(model=settings.model) as conn:
            await conn.recv()  # session.created
            await conn.session.update(session={"type": "realtime", "max_output_tokens": request.max_tokens})
            await _send_paced(conn, question)
            speech_end = time.perf_counter()
            silence = asyncio.ensure_future(_send_paced(conn, bytes(2 * REALTIME_RATE * 2)))
            try:
                async for event in conn:
                    now = time.perf_counter() - speech_end
                    if event.type == "response.output_audio_transcript.delta" and event.delta:
                        last = _on_text(result, event.delta, now, last)
                    elif event.type == "response.output_audio.delta":
                        seconds = len(base64.b64decode(event.delta)) / 2 / REALTIME_RATE
                        result.audio_chunks.append((now, seconds))
                    elif event.type == "error":
                        result.error = f"realtime error: {event.error.message}"
                        break
                    elif event.type == "response.done":
                        result.latency = now
                        result.success = answered(event.response)
                        if not result.success:
                            result.error = f"response {event.response.status}"
                        break
            finally:
                silence.cancel()
    except (openai.OpenAIError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def openai_images(client: httpx.AsyncClient, settings: BenchSettings, request: BenchRequest) -> RequestResult:
    """``/v1/images/generations``, one image per request: its latency."""
    result = RequestResult(request.prompt_words)
    body = {"model": settings.model, "prompt": request.prompt, "n": 1, "response_format": "b64_json"}
    start = time.perf_counter()
    try:
        response = await client.post(settings.url("/v1/images/generations"), json=body, headers=settings.headers(),
                                     timeout=settings.timeout_s)
        result.latency = time.perf_counter() - start
        if response.status_code != 200:
            result.error = await http_error(response)
        elif not response.json().get("data"):
            result.error = "the answer had no image"
        else:
            result.success = True
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


BACKENDS: dict[str, Backend] = {
    "openai-chat": openai_chat,
    "openai-chat-audio": openai_chat_audio,
    "openai-speech": openai_speech,
    "openai-transcription": openai_transcription,
    "openai-realtime": openai_realtime,
    "openai-images": openai_images,
}
# Backends that send speech: their requests' audio is prepared before the run.
SPEECH_IN = frozenset({"openai-transcription", "openai-realtime"})
