"""Speech in: ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``, and chat ``input_audio``.

All three run the pipeline's speech-to-text stage (an ``llm`` stage running Whisper, which says
so in its READY info: ``input_modalities: ["audio"]``) *alone*: the request enters and ends
there. Uploads are decoded by FFmpeg (PyAV) to 16 kHz mono whatever their container, and cross
to the stage as a wire tensor (shared memory above the threshold).

A chat message's ``input_audio`` parts are transcribed first and replaced by their text; the
chat request then runs as any other (vLLM's handler, or the spoken answer with
``modalities: ["audio"]``). Transcribing ahead costs no latency an edge between the stages would
save (the LLM needs the whole user turn before it answers) and keeps the conversation's earlier
turns and the LLM's chat template where vLLM's chat serving puts them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, SamplingParams

from omni_engine.audio import WHISPER_SAMPLE_RATE as SAMPLE_RATE
from omni_engine.audio import AudioDecodeError, decode_audio
from omni_engine.entrypoints.openai.audio import _served_names, error_response

router = APIRouter()

RESPONSE_FORMATS = ("json", "text", "verbose_json")
# Whisper's decoder takes 448 positions; half of them is its usual budget for one window's text.
MAX_TOKENS_PER_WINDOW = 224
# OpenAI's model name for Whisper: accepted besides the served names and the stage's own model.
OPENAI_WHISPER_NAME = "whisper-1"


class TranscriptionError(Exception):
    """A request refused before or while transcribing; ``response`` is the HTTP error."""

    def __init__(self, response: Response) -> None:
        super().__init__()
        self.response = response


def speech_to_text_stage(client: Any) -> int | None:
    """The pipeline's speech-to-text stage (READY info ``input_modalities`` has ``audio``)."""
    for sid in client.stage_ids():
        if "audio" in client.stage_info(sid).get("input_modalities", ()):
            return sid
    return None


def _stage_or_refuse(client: Any) -> int:
    sid = speech_to_text_stage(client)
    if sid is None:
        raise TranscriptionError(error_response(
            "this pipeline has no speech-to-text stage (a Whisper llm stage); audio input is not available",
            404, err_type="NotFoundError"))
    return sid


def _check_model(client: Any, sid: int, model: str | None) -> None:
    names = {*_served_names(client), str(client.stage_info(sid).get("model")), OPENAI_WHISPER_NAME}
    if model and model not in names:
        raise TranscriptionError(error_response(
            f"The model `{model}` does not exist; this pipeline transcribes with {sorted(n for n in names if n)}",
            404, "model", "NotFoundError"))


def _check_language(client: Any, sid: int, language: str | None, task: str) -> str | None:
    info = client.stage_info(sid)
    if language:
        language = language.strip().lower()
        if language not in info.get("languages", ()):
            raise TranscriptionError(error_response(
                f"language {language!r} is not supported by the speech-to-text stage; it takes "
                f"{', '.join(info.get('languages', ()))}", param="language"))
    if task == "translate" and not info.get("multilingual"):
        raise TranscriptionError(error_response(
            "the speech-to-text stage's model is English-only: it cannot translate", param="model"))
    return language or None


async def transcribe(client: Any, sid: int, audio: Any, *, language: str | None = None, task: str = "transcribe",
                     hint: str = "", temperature: float = 0.0, stream: bool = False,
                     request_id: str | None = None) -> AsyncGenerator[Any, None]:
    """The speech-to-text stage's outputs for ``audio`` (16 kHz mono samples), deltas if ``stream``."""
    params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS_PER_WINDOW,
                            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    prompt = {"prompt": hint, "multi_modal_data": {"audio": audio},
              "mm_processor_kwargs": {"language": language, "task": task}}
    rid = request_id or f"trsc-{uuid.uuid4().hex}"
    async for out in client.generate(prompt, {sid: params}, rid, entry_stage_id=sid, final_stage_id=sid):
        yield out


async def transcript_text(client: Any, sid: int, audio: Any, **kwargs: Any) -> tuple[str, dict[str, Any]]:
    """The whole transcription and its details (``language``, ``duration``, ``segments``)."""
    text, details = "", {}
    async for out in transcribe(client, sid, audio, **kwargs):
        if out.outputs:
            text = out.outputs[0].text
        details = out.multimodal_output or details
    return text.strip(), details


async def _decoded(file: UploadFile) -> Any:
    data = await file.read()
    try:
        return await asyncio.to_thread(decode_audio, data, SAMPLE_RATE)
    except AudioDecodeError as exc:
        raise TranscriptionError(error_response(f"file {file.filename!r}: {exc}", param="file")) from None


async def _handle(raw_request: Request, file: UploadFile, model: str | None, language: str | None,
                  prompt: str | None, response_format: str, temperature: float, stream: bool,
                  task: str) -> Response:
    client = raw_request.app.state.engine_client
    try:
        sid = _stage_or_refuse(client)
        _check_model(client, sid, model)
        if response_format not in RESPONSE_FORMATS:
            raise TranscriptionError(error_response(
                f"response_format {response_format!r} is not supported; use one of {list(RESPONSE_FORMATS)} "
                "(srt and vtt need word timestamps, which this stage does not produce)", param="response_format"))
        if not 0.0 <= temperature <= 1.0:
            raise TranscriptionError(error_response(f"temperature must be in [0, 1], got {temperature}",
                                                    param="temperature"))
        language = _check_language(client, sid, language, task)
        audio = await _decoded(file)
    except TranscriptionError as refused:
        return refused.response
    kwargs = dict(language=language, task=task, hint=prompt or "", temperature=temperature)
    if stream:
        return StreamingResponse(_events(client, sid, audio, kwargs), media_type="text/event-stream")
    try:
        text, details = await transcript_text(client, sid, audio, **kwargs)
    except (VLLMValidationError, ValueError) as exc:
        return error_response(str(exc))
    if response_format == "text":
        return PlainTextResponse(text + "\n")
    if response_format == "json":
        return JSONResponse({"text": text})
    return JSONResponse(_verbose(text, details, task, temperature))


def _verbose(text: str, details: dict[str, Any], task: str, temperature: float) -> dict[str, Any]:
    """OpenAI's ``verbose_json``: one segment per Whisper window (no word timestamps)."""
    from vllm.model_executor.models.whisper import ISO639_1_SUPPORTED_LANGS

    code = details.get("language", "en")
    segments = [{"id": s["id"], "seek": int(s["start"] * 100), "start": s["start"], "end": s["end"],
                 "text": s["text"], "tokens": s["tokens"], "temperature": temperature}
                for s in details.get("segments", ())]
    return {"task": task, "language": ISO639_1_SUPPORTED_LANGS.get(code, code).lower(),
            "duration": details.get("duration"), "text": text, "segments": segments}


async def _events(client: Any, sid: int, audio: Any, kwargs: dict[str, Any]) -> AsyncGenerator[str, None]:
    """``stream=true``: ``transcript.text.delta`` events as the text is decoded, then ``transcript.text.done``."""
    text = ""
    try:
        async for out in transcribe(client, sid, audio, stream=True, **kwargs):
            if out.outputs and (piece := out.outputs[0].text):
                text += piece
                yield "data: " + json.dumps({"type": "transcript.text.delta", "delta": piece}) + "\n\n"
        yield "data: " + json.dumps({"type": "transcript.text.done", "text": text.strip()}) + "\n\n"
    except Exception as exc:  # noqa: BLE001 - the status line is sent; report in the stream
        status = 400 if isinstance(exc, (VLLMValidationError, ValueError)) else 500
        yield "data: " + json.dumps({"error": {"message": str(exc), "type": type(exc).__name__,
                                               "code": status}}) + "\n\n"
    yield "data: [DONE]\n\n"


@router.post("/v1/audio/transcriptions")
async def create_transcription(raw_request: Request, file: UploadFile, model: str | None = Form(None),
                               language: str | None = Form(None), prompt: str | None = Form(None),
                               response_format: str = Form("json"), temperature: float = Form(0.0),
                               stream: bool = Form(False)) -> Response:
    return await _handle(raw_request, file, model, language, prompt, response_format, temperature, stream,
                         "transcribe")


@router.post("/v1/audio/translations")
async def create_translation(raw_request: Request, file: UploadFile, model: str | None = Form(None),
                             prompt: str | None = Form(None), response_format: str = Form("json"),
                             temperature: float = Form(0.0), stream: bool = Form(False)) -> Response:
    """Speech in any language to English text (a multilingual Whisper's ``translate`` task)."""
    return await _handle(raw_request, file, model, None, prompt, response_format, temperature, stream,
                         "translate")


# ------------------------------------------------------- chat input_audio
def has_input_audio(messages: Any) -> bool:
    return any(isinstance(part, dict) and part.get("type") == "input_audio"
               for message in messages or () if isinstance(message, dict)
               for part in (message.get("content") if isinstance(message.get("content"), list) else ()))


async def transcribe_chat_audio(client: Any, messages: list[Any]) -> None:
    """Replace every ``input_audio`` part of ``messages`` by a text part with its transcription
    (all parts transcribed at once: the stage batches them). ``TranscriptionError`` is the 400/404."""
    sid = _stage_or_refuse(client)
    parts: list[tuple[dict[str, Any], Any]] = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for p, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "input_audio":
                parts.append((part, await _chat_audio(part, f"messages[{m}].content[{p}].input_audio")))
    texts = await asyncio.gather(*(transcript_text(client, sid, audio) for _, audio in parts))
    for (part, _), (text, _details) in zip(parts, texts):
        part.clear()
        part.update(type="text", text=text)


async def _chat_audio(part: dict[str, Any], where: str) -> Any:
    spec = part.get("input_audio")
    if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
        raise TranscriptionError(error_response(f"{where} must be an object with base64 'data' and 'format'",
                                                param=where))
    try:
        data = base64.b64decode(spec["data"], validate=True)
    except (binascii.Error, ValueError):
        raise TranscriptionError(error_response(f"{where}.data is not valid base64", param=where)) from None
    try:
        return await asyncio.to_thread(decode_audio, data, SAMPLE_RATE)
    except AudioDecodeError as exc:
        raise TranscriptionError(error_response(f"{where}: {exc}", param=where)) from None
