"""Speech out: ``POST /v1/audio/speech`` (OpenAI's speech API) and ``GET /v1/audio/voices``.

The pipeline's audio stage runs *alone* (with the stages before it that take text, such as a
phonemizer; the LLM does not run): the input text goes straight to it. ``response_format`` mp3
(OpenAI's default), opus, aac, flac (encoded by FFmpeg through PyAV), wav or pcm (raw 16-bit
little-endian mono PCM at the stage's sample rate). ``stream_format`` ``audio`` streams the encoded
audio sentence by sentence; ``sse`` sends it as ``speech.audio.delta`` events.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from vllm.entrypoints.serve.utils.api_utils import validate_json_request
from vllm.exceptions import VLLMValidationError

from omni_engine.audio import (
    SPEECH_FORMATS,
    AudioFormatError,
    AudioStreamEncoder,
    check_format,
    encode_audio,
    media_type,
)
from omni_engine.entrypoints.openai.served_pipeline import (
    audio_stage_id,
    check_model,
    engine_client,
    error_response,
    speak,
    speech_dict,
    speech_params,
)
from omni_engine.pipeline.input_processors import split_sentences

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
    return JSONResponse({"object": "list", "data": mapped + engine, "variants": list(info.get("variants", ())),
                         "note": "an engine voice may take a variant: '<voice>+<variant>', e.g. 'en-us+f2'"})


# ------------------------------------------------------------------ speech
class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str
    voice: str = "en"
    response_format: str = "mp3"  # OpenAI's default
    speed: float = 1.0
    instructions: str | None = None  # accepted, ignored (eSpeak has no style prompts)
    # "audio": the encoded audio streams out sentence by sentence; "sse": as
    # speech.audio.delta events. Not given: one response once all is spoken.
    stream_format: str | None = None


@router.post("/v1/audio/speech", dependencies=[Depends(validate_json_request)])
async def create_speech(request: SpeechRequest, raw_request: Request) -> Response:
    client = engine_client(raw_request)
    sid = audio_stage_id(client)
    if sid is None:
        return error_response("this pipeline has no audio stage", 404, err_type="NotFoundError")
    if (bad := check_model(client, request.model)) is not None:
        return bad
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
    if request.stream_format is not None:
        sentences = _speak_sentences(client, sid, split_sentences(request.input), speech_dict(params), request_id)
        if request.stream_format == "sse":
            return StreamingResponse(_speech_events(sentences, request.response_format, len(request.input)),
                                     media_type="text/event-stream")
        return StreamingResponse(_speech_bytes(sentences, request.response_format),
                                 media_type=media_type(request.response_format))
    try:
        audio, rate = await speak(client, sid, request.input, speech_dict(params), request_id)
    except (VLLMValidationError, ValueError) as exc:
        return error_response(str(exc), param="voice" if "voice" in str(exc) else None)
    data = await asyncio.to_thread(encode_audio, audio, rate, request.response_format)
    headers = {"X-Sample-Rate": str(rate)} if request.response_format == "pcm" else None
    return Response(data, media_type=media_type(request.response_format), headers=headers)


async def _speak_sentences(client: Any, sid: int, sentences: list[str], params: dict[str, Any],
                           request_id: str) -> AsyncGenerator[tuple[np.ndarray, int], None]:
    """Each sentence's audio in order, as soon as it is spoken; all are submitted at once
    (the speech stage batches them). Leaving early aborts the ones not yet done."""
    tasks = [asyncio.ensure_future(speak(client, sid, text, params, f"{request_id}-{i}"))
             for i, text in enumerate(sentences)]
    try:
        for task in tasks:
            yield await task
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _speech_bytes(sentences: AsyncGenerator, fmt: str) -> AsyncGenerator[bytes, None]:
    """``stream_format: audio``: one continuous stream of ``fmt``, sent a sentence at a time."""
    encoder = None
    try:
        async for audio, rate in sentences:
            encoder = encoder or AudioStreamEncoder(fmt, rate)
            if data := encoder.feed(audio):
                yield data
        if encoder is not None and (data := encoder.close()):
            yield data
    finally:
        await sentences.aclose()


async def _speech_events(sentences: AsyncGenerator, fmt: str, input_chars: int) -> AsyncGenerator[str, None]:
    """``stream_format: sse``: ``speech.audio.delta`` events (base64 audio), then ``speech.audio.done``."""
    async for data in _speech_bytes(sentences, fmt):
        yield "data: " + json.dumps({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) + "\n\n"
    # eSpeak has no tokens: usage counts the input's characters, as OpenAI counts tokens.
    usage = {"input_tokens": input_chars, "output_tokens": 0, "total_tokens": input_chars}
    yield "data: " + json.dumps({"type": "speech.audio.done", "usage": usage}) + "\n\n"
