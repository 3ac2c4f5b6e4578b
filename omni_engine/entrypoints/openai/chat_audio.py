"""Chat with audio: ``POST /v1/chat/completions`` with ``modalities`` containing ``"audio"``.

The whole pipeline runs; the answer comes back as text and as ``message.audio`` (``id``, base64
``data``, ``expires_at``, ``transcript``), as OpenAI returns it. Streaming sends
``delta.content``/``delta.audio.transcript`` as the text is generated and ``delta.audio.data`` as
each sentence is spoken. A message's ``input_audio`` parts are transcribed first, or heard by a
text stage that hears (``speech_input``). ``audio.voice`` reaches every stage that speaks (a
talker too); ``sampling_params_list`` (vLLM-Omni's request field: one object or null per stage, in
stage order) sets any stage's sampling params, field by field, e.g. a greedy talker. Every other chat request goes to vLLM's own handler unchanged: this route
shadows vLLM's of the same path.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from vllm.entrypoints.openai.chat_completion import api_router as vllm_chat_api
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.serve.utils.api_utils import validate_json_request
from vllm.exceptions import VLLMValidationError

from omni_engine.audio import AudioFormatError, check_format, encode_audio
from omni_engine.entrypoints.openai.served_pipeline import (
    DEFAULT_SAMPLE_RATE,
    RequestRefused,
    audio_stage_id,
    chat_engine_input,
    engine_client,
    error_response,
    lora_request_of,
    served_names,
    speech_dict,
    speech_params,
    stage_params,
    with_stage_overrides,
)
from omni_engine.entrypoints.openai.speech_input import has_input_audio, prepare_chat_audio
from omni_engine.params import SpeechParams

router = APIRouter()

# Chat's audio.format names raw PCM "pcm16"; otherwise the speech formats.
CHAT_AUDIO_FORMATS = ("wav", "mp3", "opus", "aac", "flac", "pcm16")
AUDIO_EXPIRES_S = 3600


def chat_audio_bytes(audio: np.ndarray, rate: int, fmt: str) -> bytes:
    """Audio in a chat ``audio.format`` (``pcm16`` is raw 16-bit PCM)."""
    return encode_audio(audio, rate, "pcm" if fmt == "pcm16" else fmt)


def _extra(request: ChatCompletionRequest, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None and request.model_extra:
        value = request.model_extra.get(name)
    return value


@router.post("/v1/chat/completions", dependencies=[Depends(validate_json_request)])
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
    if has_input_audio(request.messages):
        try:
            await prepare_chat_audio(engine_client(raw_request), request.messages)
        except RequestRefused as refused:
            return refused.response
        except (VLLMValidationError, ValueError) as exc:
            return error_response(str(exc), param="messages")
    modalities = _extra(request, "modalities")
    if not modalities or "audio" not in modalities:
        return await vllm_chat_api.create_chat_completion(request, raw_request)
    return await _audio_chat(request, raw_request, list(modalities))


async def _audio_chat(request: ChatCompletionRequest, raw_request: Request, modalities: list[str]) -> Response:
    client = engine_client(raw_request)
    try:
        sid, fmt, speech = _chat_audio_options(client, request)
        engine_input, sampling_params, prompt_len = await chat_engine_input(client, raw_request, request)
    except RequestRefused as refused:
        return refused.response
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    model_name = request.model or (served_names(client) or ["model"])[0]
    try:
        params = with_stage_overrides(client, stage_params(client, sid, speech_dict(speech), sampling_params,
                                                           voice=speech.voice),
                                      _extra(request, "sampling_params_list"))
    except RequestRefused as refused:
        return refused.response
    stream = client.generate(engine_input, params, request_id, modalities=modalities,
                             lora_request=lora_request_of(raw_request, request.model))
    if request.stream:
        return StreamingResponse(_stream_chunks(request, stream, request_id, model_name, fmt, prompt_len),
                                 media_type="text/event-stream")
    return await _chat_audio_response(stream, request_id, model_name, fmt, prompt_len)


def _chat_audio_options(client: Any, request: ChatCompletionRequest) -> tuple[int, str, SpeechParams]:
    """The audio stage, the format and the speech parameters a chat request asks for."""
    sid = audio_stage_id(client)
    if sid is None:
        raise RequestRefused(error_response("this pipeline has no audio stage; 'audio' modality is not available",
                                      param="modalities"))
    audio_opts = _extra(request, "audio") or {}
    if not isinstance(audio_opts, dict):
        raise RequestRefused(error_response("audio must be an object with 'voice' and 'format'", param="audio"))
    fmt = audio_opts.get("format", "wav")
    if fmt not in CHAT_AUDIO_FORMATS:
        raise RequestRefused(error_response(f"audio.format {fmt!r} is not supported; use one of "
                                      f"{list(CHAT_AUDIO_FORMATS)}", param="audio.format"))
    try:
        check_format("pcm" if fmt == "pcm16" else fmt)
    except AudioFormatError as exc:
        raise RequestRefused(error_response(str(exc), param="audio.format")) from None
    if (request.n or 1) != 1 or request.use_beam_search:
        raise RequestRefused(error_response("audio output supports n=1 without beam search", param="n"))
    try:
        speech = speech_params(client, sid, audio_opts.get("voice"), audio_opts.get("speed", 1.0))
    except ValueError as exc:
        raise RequestRefused(error_response(str(exc), param="audio.voice")) from None
    return sid, fmt, speech


async def _chat_audio_response(stream: AsyncGenerator, request_id: str, model_name: str, fmt: str,
                               prompt_len: int) -> Response:
    """The whole (non-streamed) chat completion: the text and its speech in one message."""
    text, chunks, rate, completion_tokens, finish_reason = "", [], DEFAULT_SAMPLE_RATE, 0, None
    try:
        async for out in stream:
            if out.final_output_type == "audio":
                mm = out.multimodal_output
                if mm and mm.get("audio") is not None:
                    chunks.append(np.asarray(mm["audio"], dtype=np.float32).copy())
                    rate = int(mm.get("sample_rate", rate))
            elif out.outputs:
                text += out.outputs[0].text
                completion_tokens += len(out.outputs[0].token_ids)
                finish_reason = out.outputs[0].finish_reason or finish_reason
    except (VLLMValidationError, ValueError) as exc:
        return error_response(str(exc))
    finally:
        await stream.aclose()
    audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    data = await asyncio.to_thread(chat_audio_bytes, audio, rate, fmt)
    created = int(time.time())
    message = {
        "role": "assistant",
        "content": text,
        "audio": {"id": f"audio_{uuid.uuid4().hex}", "data": base64.b64encode(data).decode("ascii"),
                  "expires_at": created + AUDIO_EXPIRES_S, "transcript": text},
    }
    return JSONResponse({
        "id": request_id, "object": "chat.completion", "created": created, "model": model_name,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason or "stop"}],
        "usage": {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_len + completion_tokens},
    })


async def _stream_chunks(request: ChatCompletionRequest, stream: AsyncGenerator, request_id: str, model_name: str,
                         fmt: str, prompt_len: int) -> AsyncGenerator[str, None]:
    created = int(time.time())
    audio_id = f"audio_{uuid.uuid4().hex}"

    def sse(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> str:
        chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
                 "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
                 **extra}
        return f"data: {json.dumps(chunk)}\n\n"

    completion_tokens, finish_reason = 0, None
    try:
        yield sse({"role": "assistant", "content": ""})
        async for out in stream:
            if out.final_output_type == "audio":
                mm = out.multimodal_output
                if mm and mm.get("audio") is not None and len(mm["audio"]):
                    rate = int(mm.get("sample_rate", DEFAULT_SAMPLE_RATE))
                    data = chat_audio_bytes(mm["audio"], rate, fmt)
                    yield sse({"audio": {"id": audio_id, "data": base64.b64encode(data).decode("ascii")}})
            elif out.outputs:
                piece = out.outputs[0].text
                completion_tokens += len(out.outputs[0].token_ids)
                finish_reason = out.outputs[0].finish_reason or finish_reason
                if piece:
                    yield sse({"content": piece, "audio": {"id": audio_id, "transcript": piece}})
        yield sse({"audio": {"id": audio_id, "expires_at": created + AUDIO_EXPIRES_S}}, finish_reason or "stop")
        options = request.stream_options
        if options is not None and options.include_usage:
            usage = {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_len + completion_tokens}
            chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name,
                     "choices": [], "usage": usage}
            yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in the stream
        status = 400 if isinstance(exc, (VLLMValidationError, ValueError)) else 500
        yield f"data: {json.dumps({'error': {'message': str(exc), 'type': type(exc).__name__, 'code': status}})}\n\n"
    finally:
        await stream.aclose()
    yield "data: [DONE]\n\n"
