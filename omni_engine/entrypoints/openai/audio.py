"""Audio routes on vLLM's OpenAI-compatible app: speech and spoken chat answers.

* ``POST /v1/audio/speech`` (OpenAI's speech API): the pipeline's audio stage
  *alone* (``entry_stage_id``): the input text goes straight to the speech
  stage; the LLM does not run. ``response_format`` mp3 (OpenAI's default),
  opus, aac, flac (encoded by FFmpeg through PyAV), wav or pcm (raw 16-bit
  little-endian mono PCM at the stage's sample rate).
* ``POST /v1/chat/completions`` with ``modalities`` containing ``"audio"``: the
  whole pipeline; the answer comes back as text and as ``message.audio``
  (``id``, base64 ``data``, ``expires_at``, ``transcript``), as OpenAI returns
  it. Streaming sends ``delta.content``/``delta.audio.transcript`` as the text
  is generated and ``delta.audio.data`` as each sentence is spoken. Every other
  chat request goes to vLLM's own handler unchanged.

``add_audio_routes(app)`` puts these routes ahead of vLLM's (so the chat route
sees a request first); ``omni_engine.entrypoints.openai.app`` calls it on the
app ``omni-engine serve`` builds.
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
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from vllm.entrypoints.openai.chat_completion import api_router as vllm_chat_api
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens, validate_json_request
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, SamplingParams

from omni_engine.audio import (
    SPEECH_FORMATS,
    AudioFormatError,
    AudioStreamEncoder,
    check_format,
    encode_audio,
    media_type,
)
from omni_engine.entrypoints.openai.routing import include_router_first
from omni_engine.pipeline.input_processors import split_sentences
from omni_engine.params import SpeechParams

router = APIRouter()

# Chat's audio.format names raw PCM "pcm16"; otherwise the speech formats.
CHAT_AUDIO_FORMATS = ("wav", "mp3", "opus", "aac", "flac", "pcm16")
AUDIO_EXPIRES_S = 3600


def error_response(message: str, status: int = 400, param: str | None = None,
                   err_type: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param, "code": status}},
                        status_code=status)


def chat_audio_bytes(audio: np.ndarray, rate: int, fmt: str) -> bytes:
    """Audio in a chat ``audio.format`` (``pcm16`` is raw 16-bit PCM)."""
    return encode_audio(audio, rate, "pcm" if fmt == "pcm16" else fmt)


def _client(raw_request: Request) -> Any:
    return raw_request.app.state.engine_client


def audio_stage_id(client: Any) -> int | None:
    """The pipeline's speech stage: the first final stage with audio output."""
    return client.stage_for_output("audio")


def _served_names(client: Any) -> list[str]:
    name = getattr(client.model_config, "served_model_name", None)
    return list(name) if isinstance(name, (list, tuple)) else [name] if name else []


def _check_model(client: Any, model: str | None) -> JSONResponse | None:
    names = _served_names(client)
    if model and names and model not in names:
        return error_response(f"The model `{model}` does not exist.", 404, "model", "NotFoundError")
    return None


def _stage_params(client: Any, sid: int, params: Any, others: Any = None) -> dict[int, Any]:
    """Params by stage id: ``params`` for ``sid``, ``others`` for the text stage."""
    out = {sid: params}
    text_sid = client.text_stage_id
    if others is not None and text_sid is not None:
        out[text_sid] = others
    return out


def _speech_params(client: Any, sid: int, voice: Any, speed: Any) -> SpeechParams:
    """Checked speech params: ``ValueError`` naming a bad speed, or a voice the speech stage does not
    accept (its OpenAI names, its engine's codes, ``code+variant``), pointing at the list."""
    params = SpeechParams(voice=voice, speed=speed)
    params.validate()
    info = client.stage_info(sid)
    if "voice_map" in info and not voice_accepted(info, params.voice):
        raise ValueError(f"unknown voice {params.voice!r}; GET /v1/audio/voices lists the accepted voices "
                         f"(OpenAI's: {', '.join(sorted(info['voice_map']))})")
    return params


def voice_accepted(info: dict[str, Any], voice: str) -> bool:
    """Whether the speech stage described by ``info`` (its READY engine info) takes ``voice``."""
    voice = voice.lower()
    base, _, variant = voice.partition("+")
    return voice in info["voice_map"] or (base in info.get("voices", ()) and
                                          (not variant or variant in info.get("variants", ())))


@router.get("/v1/audio/voices")
async def list_voices(raw_request: Request) -> Response:
    """The voices the speech stage accepts: OpenAI's names (with the engine voice each is), then the engine's codes."""
    client = _client(raw_request)
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
    client = _client(raw_request)
    sid = audio_stage_id(client)
    if sid is None:
        return error_response("this pipeline has no audio stage", 404, err_type="NotFoundError")
    if (bad := _check_model(client, request.model)) is not None:
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
        params = _speech_params(client, sid, request.voice, request.speed)
    except ValueError as exc:
        return error_response(str(exc), param="speed" if "speed" in str(exc) else "voice")
    request_id = f"speech-{uuid.uuid4().hex}"
    if request.stream_format is not None:
        sentences = _speak_sentences(client, sid, split_sentences(request.input), _speech_dict(params), request_id)
        if request.stream_format == "sse":
            return StreamingResponse(_speech_events(sentences, request.response_format, len(request.input)),
                                     media_type="text/event-stream")
        return StreamingResponse(_speech_bytes(sentences, request.response_format),
                                 media_type=media_type(request.response_format))
    try:
        audio, rate = await _speak(client, sid, request.input, _speech_dict(params), request_id)
    except (VLLMValidationError, ValueError) as exc:
        return error_response(str(exc), param="voice" if "voice" in str(exc) else None)
    data = await asyncio.to_thread(encode_audio, audio, rate, request.response_format)
    headers = {"X-Sample-Rate": str(rate)} if request.response_format == "pcm" else None
    return Response(data, media_type=media_type(request.response_format), headers=headers)


async def _speak(client: Any, sid: int, text: str, params: dict[str, Any], request_id: str) -> tuple[np.ndarray, int]:
    """``text`` spoken by the speech stage (with the stages before it that take text, e.g. a
    phonemizer, but not the LLM): the whole waveform and its sample rate."""
    chunks, rate = [], 22050
    entry = client.text_entry_stage(sid)
    async for out in client.generate(text, _stage_params(client, sid, params), request_id, entry_stage_id=entry,
                                     final_stage_id=sid):
        mm = out.multimodal_output
        if mm and mm.get("audio") is not None:
            chunks.append(np.asarray(mm["audio"], dtype=np.float32).copy())
            rate = int(mm.get("sample_rate", rate))
    return (np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)), rate


async def _speak_sentences(client: Any, sid: int, sentences: list[str], params: dict[str, Any],
                           request_id: str) -> AsyncGenerator[tuple[np.ndarray, int], None]:
    """Each sentence's audio in order, as soon as it is spoken; all are submitted at once
    (the speech stage batches them). Leaving early aborts the ones not yet done."""
    tasks = [asyncio.ensure_future(_speak(client, sid, text, params, f"{request_id}-{i}"))
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


def _speech_dict(params: SpeechParams) -> dict[str, Any]:
    return {"voice": params.voice, "speed": float(params.speed)}


# -------------------------------------------------------- chat with audio
def _extra(request: ChatCompletionRequest, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None and request.model_extra:
        value = request.model_extra.get(name)
    return value


@router.post("/v1/chat/completions", dependencies=[Depends(validate_json_request)])
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
    # Imported here: the transcription module builds on this one (error_response).
    from omni_engine.entrypoints.openai.transcription import (
        TranscriptionError,
        has_input_audio,
        transcribe_chat_audio,
    )

    if has_input_audio(request.messages):
        try:
            await transcribe_chat_audio(_client(raw_request), request.messages)
        except TranscriptionError as refused:
            return refused.response
        except (VLLMValidationError, ValueError) as exc:
            return error_response(str(exc), param="messages")
    modalities = _extra(request, "modalities")
    if not modalities or "audio" not in modalities:
        return await vllm_chat_api.create_chat_completion(request, raw_request)
    return await _audio_chat(request, raw_request, list(modalities))


class _Refused(Exception):
    """A chat request refused before it reaches the pipeline; ``response`` says why."""

    def __init__(self, response: Response) -> None:
        super().__init__()
        self.response = response


async def _audio_chat(request: ChatCompletionRequest, raw_request: Request, modalities: list[str]) -> Response:
    client = _client(raw_request)
    try:
        sid, fmt, speech = _chat_audio_options(client, request)
        engine_input, sampling_params, prompt_len = await _chat_engine_input(client, raw_request, request)
    except _Refused as refused:
        return refused.response
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    model_name = request.model or (_served_names(client) or ["model"])[0]
    params = _stage_params(client, sid, _speech_dict(speech), sampling_params)
    stream = client.generate(engine_input, params, request_id, modalities=modalities)
    if request.stream:
        return StreamingResponse(_stream_chunks(request, stream, request_id, model_name, fmt, prompt_len),
                                 media_type="text/event-stream")
    return await _chat_audio_response(stream, request_id, model_name, fmt, prompt_len)


def _chat_audio_options(client: Any, request: ChatCompletionRequest) -> tuple[int, str, SpeechParams]:
    """The audio stage, the format and the speech parameters a chat request asks for."""
    sid = audio_stage_id(client)
    if sid is None:
        raise _Refused(error_response("this pipeline has no audio stage; 'audio' modality is not available",
                                      param="modalities"))
    audio_opts = _extra(request, "audio") or {}
    if not isinstance(audio_opts, dict):
        raise _Refused(error_response("audio must be an object with 'voice' and 'format'", param="audio"))
    fmt = audio_opts.get("format", "wav")
    if fmt not in CHAT_AUDIO_FORMATS:
        raise _Refused(error_response(f"audio.format {fmt!r} is not supported; use one of "
                                      f"{list(CHAT_AUDIO_FORMATS)}", param="audio.format"))
    try:
        check_format("pcm" if fmt == "pcm16" else fmt)
    except AudioFormatError as exc:
        raise _Refused(error_response(str(exc), param="audio.format")) from None
    if (request.n or 1) != 1 or request.use_beam_search:
        raise _Refused(error_response("audio output supports n=1 without beam search", param="n"))
    try:
        speech = _speech_params(client, sid, audio_opts.get("voice", "en"), audio_opts.get("speed", 1.0))
    except ValueError as exc:
        raise _Refused(error_response(str(exc), param="audio.voice")) from None
    return sid, fmt, speech


async def _chat_engine_input(client: Any, raw_request: Request,
                             request: ChatCompletionRequest) -> tuple[Any, SamplingParams, int]:
    """The rendered prompt, its sampling parameters and its length, as vLLM's chat serving makes them."""
    serving = raw_request.app.state.openai_serving_chat
    rendered = await serving.render_chat_request(request)
    if isinstance(rendered, ErrorResponse):
        raise _Refused(JSONResponse(rendered.model_dump(), status_code=rendered.error.code))
    _conversation, engine_inputs = rendered
    engine_input = engine_inputs[0]
    prompt_len = len(engine_input.get("prompt_token_ids") or [])
    try:
        max_tokens = get_max_tokens(
            client.model_config.max_model_len,
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens,
            prompt_len, serving.default_sampling_params, serving.override_max_tokens,
            truncate_prompt_tokens=request.truncate_prompt_tokens)
        sampling_params = request.to_sampling_params(max_tokens, serving.default_sampling_params)
    except ValueError as exc:
        raise _Refused(error_response(str(exc))) from None
    sampling_params.output_kind = RequestOutputKind.DELTA  # sentences reach the speech stage as they end
    try:
        client.validate_request(engine_input, sampling_params, "validate")
    except (VLLMValidationError, ValueError) as exc:
        raise _Refused(error_response(str(exc))) from None
    return engine_input, sampling_params, prompt_len


async def _chat_audio_response(stream: AsyncGenerator, request_id: str, model_name: str, fmt: str,
                               prompt_len: int) -> Response:
    """The whole (non-streamed) chat completion: the text and its speech in one message."""
    text, chunks, rate, completion_tokens, finish_reason = "", [], 22050, 0, None
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
                    rate = int(mm.get("sample_rate", 22050))
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


# ------------------------------------------------------------------ wiring
def add_audio_routes(app: FastAPI) -> FastAPI:
    """Add this module's routes ahead of vLLM's (ours shadow ``POST /v1/chat/completions``),
    the images route (``images``), the speech-in routes (``transcription``) and ``/v1/realtime``
    (``realtime``; it shadows vLLM's transcription-only WebSocket of the same path)."""
    # Both import this module.
    from omni_engine.entrypoints.openai.images import router as images_router
    from omni_engine.entrypoints.openai.realtime import router as realtime_router
    from omni_engine.entrypoints.openai.speech_stream import router as speech_stream_router
    from omni_engine.entrypoints.openai.transcription import router as transcription_router

    for extra in (router, images_router, transcription_router, realtime_router, speech_stream_router):
        app = include_router_first(app, extra)
    return app
