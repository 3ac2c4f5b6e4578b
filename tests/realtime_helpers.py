"""Helpers of the ``/v1/realtime`` server tests: a client, speech in the servers' voice, audio
streamed in 20 ms events, and events collected until one of a kind."""

from __future__ import annotations

import asyncio
import base64
import functools
import time

import numpy as np
import openai

from omni_engine.audio import wav_bytes
from omni_engine.models.prepare import prepare_model
from omni_engine.realtime.audio_io import StreamResampler

CHUNK = 480  # 20 ms at 24 kHz


def aclient(server) -> openai.AsyncOpenAI:
    # (a server without --api-key takes any key; the client insists on one)
    return openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key=server["api_key"] or "EMPTY", max_retries=0,
                              timeout=120)


@functools.cache
def _still_voice():
    """Piper itself (piper-tts, not a stage) with the server's voice, its noise off: VITS samples noise
    at every synthesis, and a question that sounds different in every run was once heard as another word."""
    from piper import PiperVoice
    from piper.config import SynthesisConfig

    voice = PiperVoice.load(next(prepare_model("piper-joe").glob("*.onnx")))
    return voice, SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0, normalize_audio=False)


def spoken(text: str) -> np.ndarray:
    """``text`` spoken by the servers' Piper voice, the same samples every run, as int16 PCM at 24 kHz
    (the session's input format)."""
    voice, config = _still_voice()
    samples = np.concatenate([chunk.audio_float_array for chunk in voice.synthesize(text, syn_config=config)])
    resampler = StreamResampler(voice.config.sample_rate, 24000)
    audio = np.concatenate([resampler.feed(samples.astype(np.float32)), resampler.flush()])
    return (np.clip(audio, -1, 1) * 32767).astype("<i2")


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(24000 * seconds), dtype="<i2")


async def stream_audio(conn, audio: np.ndarray, realtime: bool = False) -> None:
    """``audio`` in 20 ms ``input_audio_buffer.append`` events (at the pace of speech if ``realtime``)."""
    for i in range(0, len(audio), CHUNK):
        await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i:i + CHUNK].tobytes()).decode())
        if realtime:
            await asyncio.sleep(0.02)


async def events_until(conn, kind: str, timeout: float = 120.0, into: list | None = None):
    """Events received up to and including the first of type ``kind``."""
    seen = [] if into is None else into
    async with asyncio.timeout(timeout):
        async for ev in conn:
            seen.append((time.monotonic(), ev))
            if ev.type == kind:
                return seen
    raise AssertionError(f"connection closed before {kind}")


def of_type(events, kind: str) -> list:
    return [ev for _, ev in events if ev.type == kind]


def answer_audio(events) -> np.ndarray:
    data = b"".join(base64.b64decode(ev.delta) for ev in of_type(events, "response.output_audio.delta"))
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def heard(client, audio24k: np.ndarray) -> str:
    """What the server's Whisper stage hears in the answer's audio."""
    return client.audio.transcriptions.create(model="whisper-1", file=("answer.wav", wav_bytes(audio24k, 24000))).text
