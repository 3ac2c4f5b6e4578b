"""``/v1/audio/speech/stream``: a WebSocket that takes text as it is written and speaks it sentence by sentence.

The session logic is ``omni_engine.realtime.speech_stream``; the realtime route's ``serve_session``
runs the connection (model check, one writer, receive loop, abort on close), and this module speaks each sentence
through the speech stage alone, as ``POST /v1/audio/speech`` does (the LLM does not run).
``--api-key`` guards the handshake (``auth``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter, WebSocket

from omni_engine.entrypoints.openai.audio import _speak, _speech_dict, _speech_params, audio_stage_id
from omni_engine.entrypoints.openai.realtime import refusal_event, serve_session
from omni_engine.realtime.speech_stream import SpeechStreamSession

router = APIRouter()


@router.websocket("/v1/audio/speech/stream")
async def speech_stream(websocket: WebSocket) -> None:
    client = websocket.app.state.engine_client
    sid = audio_stage_id(client)

    async def speak(text: str, voice: str, speed: float, request_id: str) -> tuple[np.ndarray, int]:
        params = _speech_params(client, sid, voice, speed)  # checked when set; cheap to redo
        return await _speak(client, sid, text, _speech_dict(params), request_id)

    def check_voice(voice: str, speed: float) -> Any:
        return _speech_params(client, sid, voice, speed)

    refused = None if sid is not None else refusal_event("no_audio_stage", None,
                                                         "this pipeline has no audio stage to speak with")
    await serve_session(websocket, lambda send: SpeechStreamSession(speak, send, check_voice=check_voice), refused)
