"""One request per API, timed as its answer streams in: the request functions of ``bench serve``.

Each backend sends one ``BenchRequest`` and returns a ``RequestResult``: when each piece of text
and audio arrived (seconds after the request was sent), what the server said it produced, or the
error. Text timings follow ``vllm bench serve``: time to first token is the first content chunk,
inter-token latencies the gaps between content chunks, output tokens from the stream's ``usage``.
"""

from __future__ import annotations

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

    def url(self, default_endpoint: str) -> str:
        return self.base_url.rstrip("/") + (self.endpoint or default_endpoint)

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


def _chat_body(settings: BenchSettings, request: BenchRequest) -> dict[str, Any]:
    body = {"model": settings.model, "messages": [{"role": "user", "content": request.prompt}],
            "max_completion_tokens": request.max_tokens, "temperature": settings.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if settings.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _stream_chat(client: httpx.AsyncClient, settings: BenchSettings, request: BenchRequest,
                       body: dict[str, Any]) -> RequestResult:
    result = RequestResult(request.prompt_words)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", settings.url("/v1/chat/completions"), json=body,
                                 headers=settings.headers(), timeout=settings.timeout_s) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return result
            async for event in sse_events(response):
                now = time.perf_counter()
                if usage := event.get("usage"):
                    result.output_tokens = usage.get("completion_tokens") or 0
                    result.prompt_tokens = usage.get("prompt_tokens") or 0
                for choice in event.get("choices") or ():
                    delta = choice.get("delta") or {}
                    audio = delta.get("audio") or {}
                    if audio.get("data"):
                        result.audio_chunks.append((now - start, wav_seconds(base64.b64decode(audio["data"]))))
                    if delta.get("content"):
                        if not result.text:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        result.text += delta["content"]
        result.latency = time.perf_counter() - start
        result.success = True
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
    return await _stream_chat(client, settings, request, body)


async def openai_speech(client: httpx.AsyncClient, settings: BenchSettings, request: BenchRequest) -> RequestResult:
    """``/v1/audio/speech``, the prompt read aloud, streamed as WAV bytes (``stream_format: audio``)."""
    result = RequestResult(request.prompt_words)
    body = {"model": settings.model, "input": request.prompt, "response_format": "wav", "stream_format": "audio",
            **({"voice": settings.voice} if settings.voice else {})}
    start = time.perf_counter()
    stream = WavStream()
    try:
        async with client.stream("POST", settings.url("/v1/audio/speech"), json=body, headers=settings.headers(),
                                 timeout=settings.timeout_s) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                return result
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


BACKENDS: dict[str, Backend] = {
    "openai-chat": openai_chat,
    "openai-chat-audio": openai_chat_audio,
    "openai-speech": openai_speech,
}
