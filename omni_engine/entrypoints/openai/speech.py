"""Speech out: ``POST /v1/audio/speech`` (OpenAI's speech API) and ``GET /v1/audio/voices``.

The pipeline's audio stage runs *alone* (with the stages before it that take text, such as a
phonemizer; the LLM does not run): the input text goes straight to it. ``response_format`` mp3
(OpenAI's default), opus, aac, flac (encoded by FFmpeg through PyAV), wav or pcm (raw 16-bit
little-endian mono PCM at the stage's sample rate, named in ``X-Sample-Rate``).

The answer streams as it is spoken, as OpenAI's does (chunked transfer): the passage is cut into
pieces (its first clause or first words, then whole sentences), all submitted at once, each with
the moment its listener will need it (``deadlines``: the first now, each later one when the audio
before it has played at 1x), and each piece's audio is encoded and sent as soon as it and the
pieces before it exist. A client that reads the whole body gets the same file, byte for byte, but
for the sizes a muxer rewrites at the end of a file it can seek in (WAV's, FLAC's). An error
before the first audio is an OpenAI-shaped JSON error; after it, the stream is cut short.
``stream_format`` ``sse`` sends the same audio as ``speech.audio.delta`` events; ``audio``
(OpenAI's default) is the raw stream.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from vllm.entrypoints.serve.utils.api_utils import validate_json_request
from vllm.exceptions import VLLMValidationError

from omni_engine.audio import SPEECH_FORMATS, AudioFormatError, AudioStreamEncoder, check_format, media_type
from omni_engine.entrypoints.openai.served_pipeline import (
    audio_stage_id,
    check_model,
    engine_client,
    error_response,
    speak,
    speech_dict,
    speech_params,
    text_speech_refusal,
)
from omni_engine.pipeline.input_processors import split_for_speech
from omni_engine.pipeline.playback_clock import PlaybackClock

logger = logging.getLogger(__name__)
router = APIRouter()


@router.get("/v1/audio/voices")
async def list_voices(raw_request: Request) -> Response:
    """The voices the speech stage accepts: OpenAI's names (with the engine voice each is), then the engine's codes."""
    client = engine_client(raw_request)
    sid = audio_stage_id(client)
    if sid is None:
        return error_response("this pipeline has no audio stage", 404, err_type="NotFoundError")
    info = client.stage_info(sid)
    mapped = [{"id": name, "object": "voice", "kind": "openai", "engine_voice": voice}
              for name, voice in sorted(info.get("voice_map", {}).items())]
    engine = [{"id": code, "object": "voice", "kind": "engine"} for code in info.get("voices", ())]
    listing: dict[str, Any] = {"object": "list", "data": mapped + engine}
    if "default_voice" in info:
        listing["default"] = info["default_voice"]
    if info.get("variants"):
        listing["variants"] = list(info["variants"])
        listing["note"] = "an engine voice may take a variant: '<voice>+<variant>', e.g. 'en-us+f2'"
    return JSONResponse(listing)


# ------------------------------------------------------------------ speech
class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str
    voice: str = "en"
    response_format: str = "mp3"  # OpenAI's default
    speed: float = 1.0
    instructions: str | None = None  # accepted, ignored (eSpeak has no style prompts)
    # "audio" (or not given): the encoded audio streams as it is spoken; "sse": as
    # speech.audio.delta events.
    stream_format: str | None = None


@router.post("/v1/audio/speech", dependencies=[Depends(validate_json_request)])
async def create_speech(request: SpeechRequest, raw_request: Request) -> Response:
    client = engine_client(raw_request)
    sid = audio_stage_id(client)
    if sid is None:
        return error_response("this pipeline has no audio stage", 404, err_type="NotFoundError")
    if (bad := check_model(client, request.model)) is not None:
        return bad
    if (refusal := text_speech_refusal(client, sid)) is not None:
        return error_response(refusal, param="input")
    if request.response_format not in SPEECH_FORMATS:
        return error_response(f"response_format {request.response_format!r} is not supported; "
                              f"use one of {list(SPEECH_FORMATS)}", param="response_format")
    try:
        check_format(request.response_format)
    except AudioFormatError as exc:
        return error_response(str(exc), param="response_format")
    if not request.input.strip():
        return error_response("input must not be empty", param="input")
    if request.stream_format not in (None, "audio", "sse"):
        return error_response(f"stream_format {request.stream_format!r} is not supported; use 'audio' or 'sse'",
                              param="stream_format")
    try:
        params = speech_params(client, sid, request.voice, request.speed)
    except ValueError as exc:
        return error_response(str(exc), param="speed" if "speed" in str(exc) else "voice")
    request_id = f"speech-{uuid.uuid4().hex}"
    pieces = split_for_speech(request.input)
    spoken = speak_pieces(client, sid, pieces, speech_dict(params), request_id)
    try:
        first = await anext(spoken)  # a failure before any audio is still a proper error response
    except (VLLMValidationError, ValueError) as exc:
        await spoken.aclose()
        return error_response(str(exc), param="voice" if "voice" in str(exc) else None)
    except BaseException:
        await spoken.aclose()
        raise
    body = _speech_bytes(first, spoken, request.response_format, request_id)
    if request.stream_format == "sse":
        return StreamingResponse(_speech_events(body, len(request.input)), media_type="text/event-stream")
    headers = {"X-Sample-Rate": str(first[1])} if request.response_format == "pcm" else None
    return StreamingResponse(body, media_type=media_type(request.response_format), headers=headers)


async def speak_pieces(client: Any, sid: int, pieces: list[str], params: dict[str, Any],
                       request_id: str) -> AsyncGenerator[tuple[np.ndarray, int], None]:
    """Each piece's audio in order, as soon as it is spoken. All are submitted at once, piece k due
    when pieces 0..k-1 (their length estimated from their text) have played from now: the speech
    stage serves every listener's most urgent piece first. Leaving early aborts the ones not done."""
    clock = PlaybackClock(time.time(), float(params.get("speed", 1.0)))
    for k, text in enumerate(pieces):
        clock.note_input(k, text)
    tasks = [asyncio.ensure_future(speak(client, sid, text, params, f"{request_id}-{k}", deadline=clock.deadline(k)))
             for k, text in enumerate(pieces)]
    try:
        for task in tasks:
            yield await task
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _speech_bytes(first: tuple[np.ndarray, int], rest: AsyncGenerator, fmt: str,
                        request_id: str) -> AsyncGenerator[bytes, None]:
    """One continuous stream of ``fmt``, sent a piece at a time from ``first`` on."""
    audio, rate = first
    encoder = AudioStreamEncoder(fmt, rate)
    try:
        if data := encoder.feed(audio):
            yield data
        async for audio, _ in rest:
            if data := encoder.feed(audio):
                yield data
        if data := encoder.close():
            yield data
    except Exception:
        logger.exception("speech %s failed after its first audio was sent; the stream ends short", request_id)
        raise
    finally:
        await rest.aclose()


async def _speech_events(body: AsyncGenerator[bytes, None], input_chars: int) -> AsyncGenerator[str, None]:
    """``stream_format: sse``: ``speech.audio.delta`` events (base64 audio), then ``speech.audio.done``."""
    try:
        async for data in body:
            yield "data: " + json.dumps({"type": "speech.audio.delta",
                                         "audio": base64.b64encode(data).decode()}) + "\n\n"
    finally:
        await body.aclose()
    # eSpeak has no tokens: usage counts the input's characters, as OpenAI counts tokens.
    usage = {"input_tokens": input_chars, "output_tokens": 0, "total_tokens": input_chars}
    yield "data: " + json.dumps({"type": "speech.audio.done", "usage": usage}) + "\n\n"
