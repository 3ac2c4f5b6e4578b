"""``/v1/audio/speech/stream``: a WebSocket that takes text as it is written and speaks it sentence by sentence.

The session logic is ``omni_engine.realtime.speech_stream``; ``event_socket.serve_session``
runs the connection (model check, one writer, receive loop, abort on close), and this module speaks each sentence
through the speech stage alone, as ``POST /v1/audio/speech`` does (the LLM does not run).
``--api-key`` guards the handshake (``auth``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, WebSocket

from omni_engine.entrypoints.openai.event_socket import refusal_event, serve_session
from omni_engine.entrypoints.openai.served_pipeline import (
    audio_stage_id,
    engine_client,
    speak,
    speech_dict,
    speech_params,
    text_speech_refusal,
)
from omni_engine.realtime.speech_stream import SpeechStreamSession

router = APIRouter()


@router.websocket("/v1/audio/speech/stream")
async def speech_stream(websocket: WebSocket) -> None:
    client = engine_client(websocket)
    sid = audio_stage_id(client)

    async def speak_sentence(text: str, voice: str, speed: float, request_id: str,
                             deadline: float) -> tuple[np.ndarray, int]:
        params = speech_params(client, sid, voice, speed)  # checked when set; cheap to redo
        return await speak(client, sid, text, speech_dict(params), request_id, deadline)

    def check_voice(voice: str, speed: float) -> Any:
        return speech_params(client, sid, voice, speed)

    refused = None if sid is not None else refusal_event("no_audio_stage", None,
                                                         "this pipeline has no audio stage to speak with")
    if refused is None and (why := text_speech_refusal(client, sid)) is not None:
        refused = refusal_event("no_text_speech_stage", None, why)
    await serve_session(websocket, lambda send: SpeechStreamSession(speak_sentence, send, check_voice=check_voice),
                        refused)
