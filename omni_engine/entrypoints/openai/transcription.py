"""Speech in: ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``.

Both run the pipeline's speech-to-text stage (an ``llm`` stage running Whisper) *alone*
(``speech_input``). Uploads are decoded by FFmpeg (PyAV) to 16 kHz mono whatever their
container. Chat's ``input_audio`` goes through the same stage (``chat_audio``, via
``speech_input.transcribe_chat_audio``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from vllm.exceptions import VLLMValidationError

from omni_engine.entrypoints.openai.served_pipeline import RequestRefused, engine_client, error_response, served_names
from omni_engine.entrypoints.openai.speech_input import (
    decoded_audio,
    speech_to_text_stage_or_refuse,
    transcribe,
    transcript_text,
)

router = APIRouter()

RESPONSE_FORMATS = ("json", "text", "verbose_json")
# OpenAI's model name for Whisper: accepted besides the served names and the stage's own model.
OPENAI_WHISPER_NAME = "whisper-1"


def _check_model(client: Any, sid: int, model: str | None) -> None:
    names = {*served_names(client), str(client.stage_info(sid).get("model")), OPENAI_WHISPER_NAME}
    if model and model not in names:
        raise RequestRefused(error_response(
            f"The model `{model}` does not exist; this pipeline transcribes with {sorted(n for n in names if n)}",
            404, "model", "NotFoundError"))


def _check_language(client: Any, sid: int, language: str | None, task: str) -> str | None:
    info = client.stage_info(sid)
    if language:
        language = language.strip().lower()
        if language not in info.get("languages", ()):
            raise RequestRefused(error_response(
                f"language {language!r} is not supported by the speech-to-text stage; it takes "
                f"{', '.join(info.get('languages', ()))}", param="language"))
    if task == "translate" and not info.get("multilingual"):
        raise RequestRefused(error_response(
            "the speech-to-text stage's model is English-only: it cannot translate", param="model"))
    return language or None


async def _handle(raw_request: Request, file: UploadFile, model: str | None, language: str | None,
                  prompt: str | None, response_format: str, temperature: float, stream: bool,
                  task: str) -> Response:
    client = engine_client(raw_request)
    try:
        sid = speech_to_text_stage_or_refuse(client)
        _check_model(client, sid, model)
        if response_format not in RESPONSE_FORMATS:
            raise RequestRefused(error_response(
                f"response_format {response_format!r} is not supported; use one of {list(RESPONSE_FORMATS)} "
                "(srt and vtt need word timestamps, which this stage does not produce)", param="response_format"))
        if not 0.0 <= temperature <= 1.0:
            raise RequestRefused(error_response(f"temperature must be in [0, 1], got {temperature}",
                                                param="temperature"))
        language = _check_language(client, sid, language, task)
        audio = await decoded_audio(await file.read(), f"file {file.filename!r}", "file")
    except RequestRefused as refused:
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
