"""Speech in through the pipeline's speech-to-text stage: what the transcription, chat and realtime
routes share.

The stage is an ``llm`` stage running Whisper (its READY info says ``input_modalities: ["audio"]``)
and runs *alone*: the request enters and ends there. Audio crosses to it as 16 kHz mono samples in
a wire tensor (shared memory above the threshold).

A chat message's ``input_audio`` parts are transcribed first and replaced by their text; the chat
request then runs as any other. Where the text stage's model hears itself (Qwen-Omni's thinker: its
READY info's ``prompt_modalities`` has ``audio``), the parts go to it instead, through vLLM's chat
rendering and multimodal processor: decoded here (any container FFmpeg reads; one that does not
decode is refused by its place in the request) and handed on as 16 kHz float32 WAV. Not as they
came: vLLM 0.32's PyAV decoder hands on integer samples unscaled where it does not resample, which
it never does for a chat part (a 16-bit WAV reaches the model 32768 times too loud). Transcribing ahead costs no latency an edge between the stages
would save (the LLM needs the whole user turn before it answers) and keeps the conversation's
earlier turns and the LLM's chat template where vLLM's chat serving puts them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from vllm.sampling_params import RequestOutputKind, SamplingParams

from omni_engine.audio import WHISPER_SAMPLE_RATE as SAMPLE_RATE
from omni_engine.audio import AudioDecodeError, decode_audio, wav_float_bytes
from omni_engine.entrypoints.openai.served_pipeline import (
    RequestRefused,
    error_response,
    speech_to_text_stage,
    text_stage_hears,
)

# Whisper's decoder takes 448 positions; half of them is its usual budget for one window's text.
MAX_TOKENS_PER_WINDOW = 224


def speech_to_text_stage_or_refuse(client: Any) -> int:
    """The speech-to-text stage; ``RequestRefused`` (404) when the pipeline has none."""
    sid = speech_to_text_stage(client)
    if sid is None:
        raise RequestRefused(error_response(
            "this pipeline has no speech-to-text stage (a Whisper llm stage); audio input is not available",
            404, err_type="NotFoundError"))
    return sid


async def decoded_audio(data: bytes, where: str, param: str) -> Any:
    """``data`` (any container FFmpeg reads) as 16 kHz mono samples; ``RequestRefused`` naming ``where``
    (what the bytes were) and the request field ``param`` they came in."""
    try:
        return await asyncio.to_thread(decode_audio, data, SAMPLE_RATE)
    except AudioDecodeError as exc:
        raise RequestRefused(error_response(f"{where}: {exc}", param=param)) from None


async def transcribe(client: Any, sid: int, audio: Any, *, language: str | None = None, task: str = "transcribe",
                     hint: str = "", temperature: float = 0.0, stream: bool = False,
                     request_id: str | None = None, deadline: float | None = None) -> AsyncGenerator[Any, None]:
    """The speech-to-text stage's outputs for ``audio`` (16 kHz mono samples), deltas if ``stream``.
    ``deadline``: a live turn's is now (it goes before batch transcriptions, which have none)."""
    params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS_PER_WINDOW,
                            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    prompt = {"prompt": hint, "multi_modal_data": {"audio": audio},
              "mm_processor_kwargs": {"language": language, "task": task}}
    rid = request_id or f"trsc-{uuid.uuid4().hex}"
    async for out in client.generate(prompt, {sid: params}, rid, entry_stage_id=sid, final_stage_id=sid,
                                     deadline=deadline):
        yield out


async def transcript_text(client: Any, sid: int, audio: Any, **kwargs: Any) -> tuple[str, dict[str, Any]]:
    """The whole transcription and its details (``language``, ``duration``, ``segments``)."""
    text, details = "", {}
    async for out in transcribe(client, sid, audio, **kwargs):
        if out.outputs:
            text = out.outputs[0].text
        details = out.multimodal_output or details
    return text.strip(), details


# ------------------------------------------------------- chat input_audio
def has_input_audio(messages: Any) -> bool:
    """Whether any chat message has an ``input_audio`` content part."""
    return any(isinstance(part, dict) and part.get("type") == "input_audio"
               for message in messages or () if isinstance(message, dict)
               for part in (message.get("content") if isinstance(message.get("content"), list) else ()))


async def prepare_chat_audio(client: Any, messages: list[Any]) -> None:
    """``messages``' ``input_audio`` parts made ready for the text stage: heard by it (as WAV) where its
    model hears, else transcribed. ``RequestRefused`` is the 400/404."""
    if text_stage_hears(client):
        for part, audio in await _audio_parts(messages):
            wav = await asyncio.to_thread(wav_float_bytes, audio, SAMPLE_RATE)
            part["input_audio"] = {"data": base64.b64encode(wav).decode("ascii"), "format": "wav"}
    else:
        await transcribe_chat_audio(client, messages)


async def _audio_parts(messages: list[Any]) -> list[tuple[dict[str, Any], Any]]:
    """Every ``input_audio`` part of ``messages`` with its decoded samples (16 kHz mono)."""
    parts: list[tuple[dict[str, Any], Any]] = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for p, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "input_audio":
                parts.append((part, await _input_audio(part, f"messages[{m}].content[{p}].input_audio")))
    return parts


async def transcribe_chat_audio(client: Any, messages: list[Any]) -> None:
    """Replace every ``input_audio`` part of ``messages`` by a text part with its transcription
    (all parts transcribed at once: the stage batches them). ``RequestRefused`` is the 400/404."""
    sid = speech_to_text_stage_or_refuse(client)
    parts = await _audio_parts(messages)
    texts = await asyncio.gather(*(transcript_text(client, sid, audio) for _, audio in parts))
    for (part, _), (text, _details) in zip(parts, texts):
        part.clear()
        part.update(type="text", text=text)


async def _input_audio(part: dict[str, Any], where: str) -> Any:
    spec = part.get("input_audio")
    if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
        raise RequestRefused(error_response(f"{where} must be an object with base64 'data' and 'format'",
                                            param=where))
    try:
        data = base64.b64decode(spec["data"], validate=True)
    except (binascii.Error, ValueError):
        raise RequestRefused(error_response(f"{where}.data is not valid base64", param=where)) from None
    return await decoded_audio(data, where, where)
