"""``/v1/realtime``: OpenAI's Realtime API (a WebSocket) over the pipeline.

The session logic is ``omni_engine.realtime``; ``event_socket.serve_session`` runs the connection
(one writer task, so events from the response and transcription tasks keep their order and never
interleave); this module implements ``RealtimeEngine`` over the
``MultiStageEngineClient``: speech in through the speech-to-text stage alone (as
``/v1/audio/transcriptions``), or, where the LLM hears (Qwen-Omni's thinker), each turn's audio
in its chat as an ``input_audio`` part; answers through the whole pipeline as a chat completion with
``modalities: ["audio"]`` (vLLM's own chat rendering, so the LLM's chat template, and its
context length bounds the history). ``--api-key`` guards the handshake (``auth``).

With tools, the chat request carries them (the chat template shows them to the LLM) and the
answer goes through the server's tool parser as vLLM's streamed chat completions do
(``--enable-auto-tool-choice --tool-call-parser ...``): its text as text, its calls as
``FunctionCallDelta``s. The speech stage never hears a call (``input_processors.SpokenSentences``).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, WebSocket
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.exceptions import VLLMValidationError

from omni_engine.entrypoints.openai.event_socket import serve_session
from omni_engine.entrypoints.openai.served_pipeline import (
    DEFAULT_SAMPLE_RATE,
    RequestRefused,
    audio_stage_id,
    chat_engine_input,
    engine_client,
    served_names,
    speech_dict,
    speech_params,
    speech_to_text_stage,
    stage_params,
    text_stage_hears,
)
from omni_engine.entrypoints.openai.speech_input import transcript_text
from omni_engine.outputs import SPOKEN_TEXT
from omni_engine.realtime.config import SessionConfigError
from omni_engine.realtime.engine import AudioChunk, FunctionCallDelta, ResponsePiece, ResponseStart, TextDelta
from omni_engine.realtime.session import RealtimeSession
from omni_engine.tracing.context import REQUEST_TRACE_HEADERS

logger = logging.getLogger(__name__)

router = APIRouter()

# Leave the answer this many tokens when the history is cut to fit the LLM's context.
MIN_ANSWER_TOKENS = 64


def _without_oldest_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """``messages`` less the oldest message after the instructions (and the outputs of calls it made);
    None when only the last one is left."""
    first = 1 if messages and messages[0]["role"] == "system" else 0
    rest = messages[first + 1:]
    while len(rest) > 1 and rest[0]["role"] == "tool":  # an output without its call means nothing
        rest = rest[1:]
    if not rest:
        return None
    return messages[:first] + rest


# Chat content parts by the modality vLLM's input processor counts them under.
_PART_MODALITY = {"input_audio": "audio", "audio_url": "audio", "image_url": "image", "video_url": "video"}


def _media_parts(messages: list[dict[str, Any]]) -> Counter[str]:
    return Counter(_PART_MODALITY[part["type"]] for message in messages if isinstance(message.get("content"), list)
                   for part in message["content"] if part.get("type") in _PART_MODALITY)


def within_media_limits(messages: list[dict[str, Any]], limit: Callable[[str], int]) -> list[dict[str, Any]]:
    """``messages`` less their oldest turns until no modality has more parts than the LLM takes in one
    prompt (``limit``): a spoken conversation soon holds more turns of audio than a thinker hears at
    once (Qwen-Omni's configs: one), and, as for its context, its latest turns are the ones kept."""
    while any(n > limit(modality) for modality, n in _media_parts(messages).items()):
        shorter = _without_oldest_turn(messages)
        if shorter is None:  # the new turn alone is too much: vLLM's renderer says so, by name
            break
        messages = shorter
    return messages


def _tool_deltas(delta: Any) -> list[FunctionCallDelta]:
    """The function-call pieces of a vLLM ``DeltaMessage``."""
    pieces = []
    for call in getattr(delta, "tool_calls", None) or ():
        function = call.function
        name = function.get("name") if isinstance(function, dict) else getattr(function, "name", None)
        arguments = function.get("arguments") if isinstance(function, dict) else getattr(function, "arguments", None)
        pieces.append(FunctionCallDelta(call.index, call.id, name, arguments or ""))
    return pieces


class PipelineRealtimeEngine:
    """``RealtimeEngine`` over a ``MultiStageEngineClient`` and the app's chat serving."""

    def __init__(self, websocket: WebSocket) -> None:
        self._scope = websocket  # chat_engine_input reads .app.state.openai_serving_chat
        self.client = engine_client(websocket)
        self.stt_stage = speech_to_text_stage(self.client)
        self.speech_stage = audio_stage_id(self.client)
        self.can_hear = self.stt_stage is not None
        self.can_speak = self.speech_stage is not None
        self.hears_audio = text_stage_hears(self.client)  # Qwen-Omni's thinker: the turn's audio goes to it
        info = self.client.stage_info(self.speech_stage) if self.speech_stage is not None else {}
        # A model's own speakers (no OpenAI voice names to map): its default, not OpenAI's "alloy".
        self.default_voice = info.get("default_voice") if "voice_map" not in info and info.get("voices") else None
        # The session's trace context (the WebSocket's traceparent, read by the server's middleware).
        self._trace_headers = REQUEST_TRACE_HEADERS.get()
        self._chat = websocket.app.state.openai_serving_chat
        self.can_call_tools = bool(self._chat is not None and self._chat.enable_auto_tools
                                   and self._chat.parser_cls is not None
                                   and self._chat.parser_cls.tool_parser_cls is not None)

    def start_turn(self, item_id: str | None) -> Any:
        tracer = self.client.tracer
        return tracer.start_turn(item_id, self._trace_headers) if tracer is not None else None

    def check_voice(self, voice: str, speed: float) -> None:
        if self.speech_stage is None:
            return
        try:
            speech_params(self.client, self.speech_stage, voice, speed)
        except ValueError as exc:
            raise SessionConfigError(str(exc), "session.audio.output.voice" if "voice" in str(exc)
                                     else "session.audio.output.speed") from None

    def check_language(self, language: str | None) -> None:
        if language and self.stt_stage is not None:
            languages = self.client.stage_info(self.stt_stage).get("languages", ())
            if language not in languages:
                raise SessionConfigError(f"transcription language {language!r} is not supported; the "
                                         f"speech-to-text stage takes {', '.join(languages)}",
                                         "session.audio.input.transcription.language")

    async def transcribe(self, audio: np.ndarray, *, language: str | None, prompt: str | None,
                         request_id: str) -> str:
        # A live turn: its listener waits for the answer now (before any batch transcription).
        text, _details = await transcript_text(self.client, self.stt_stage, audio, language=language,
                                               hint=prompt or "", request_id=request_id, deadline=time.time())
        return text

    async def _engine_input(self, messages: list[dict[str, Any]], max_tokens: int | None,
                            temperature: float | None, tools: list[dict[str, Any]],
                            tool_choice: str | dict[str, Any]) -> tuple[Any, Any, int, ChatCompletionRequest]:
        """The rendered chat prompt; the oldest turns are left out until it fits the LLM's context."""
        limit = self.client.model_config.max_model_len
        # Unset in the session: the text stage's configured defaults (vLLM's chat would take the model's).
        defaults = self.client.stage_default_params(self.client.text_stage_id)
        temperature = defaults.get("temperature") if temperature is None else temperature
        max_tokens = defaults.get("max_tokens") if max_tokens is None else max_tokens
        # tool_choice "none": the LLM does not see the tools (vLLM's default would still show them).
        with_tools = {"tools": tools, "tool_choice": tool_choice} if tools and tool_choice != "none" else {}
        mm_config = self.client.model_config.multimodal_config
        if mm_config is not None:
            messages = within_media_limits(messages, mm_config.get_limit_per_prompt)
        while True:
            request = ChatCompletionRequest(model=(served_names(self.client) or [None])[0], messages=messages,
                                            max_completion_tokens=max_tokens, temperature=temperature,
                                            **with_tools)
            try:
                engine_input, params, prompt_len = await chat_engine_input(self.client, self._scope, request)
            except RequestRefused as refused:
                error = json.loads(refused.response.body).get("error")
                message = str(error.get("message") if isinstance(error, dict) else error)
            except (ValueError, VLLMValidationError) as exc:  # vLLM's renderer raises its validation errors
                message = str(exc)
            else:
                if prompt_len + MIN_ANSWER_TOKENS <= limit or (shorter := _without_oldest_turn(messages)) is None:
                    return engine_input, params, prompt_len, request
                messages = shorter
                continue
            too_long = any(word in message.lower() for word in ("context", "too long", "maximum"))
            if not too_long or (shorter := _without_oldest_turn(messages)) is None:
                raise ValueError(message)
            messages = shorter

    async def respond(self, messages: list[dict[str, Any]], *, audio: bool, voice: str, speed: float,
                      max_tokens: int | None, temperature: float | None, tools: list[dict[str, Any]],
                      tool_choice: str | dict[str, Any], request_id: str) -> AsyncGenerator[ResponsePiece, None]:
        if self.client.text_stage_id is None:
            raise ValueError("this pipeline has no text (llm) stage to answer with")
        engine_input, sampling_params, prompt_len, request = await self._engine_input(
            messages, max_tokens, temperature, tools, tool_choice)
        parser = self._tool_parser(request) if request.tools else None
        prompt_ids = engine_input.get("prompt_token_ids")
        yield ResponseStart(prompt_len)
        if audio:
            speech = speech_params(self.client, self.speech_stage, voice, speed)
            params = stage_params(self.client, self.speech_stage, speech_dict(speech), sampling_params,
                                  voice=speech.voice)
            stream = self.client.generate(engine_input, params, request_id, modalities=["text", "audio"])
        else:
            stream = self.client.generate(engine_input, sampling_params, request_id, modalities=["text"])
        try:
            async for out in stream:
                if out.final_output_type == "audio":
                    mm = out.multimodal_output
                    if mm and mm.get("audio") is not None:
                        spoken = mm.get(SPOKEN_TEXT)
                        yield AudioChunk(np.asarray(mm["audio"], dtype=np.float32).copy(),
                                         int(mm.get("sample_rate", DEFAULT_SAMPLE_RATE)),
                                         spoken if isinstance(spoken, str) else None)
                elif out.outputs:
                    for text_piece in _text_pieces(out.outputs[0], parser, request, prompt_ids):
                        yield text_piece
        finally:
            await stream.aclose()

    def _tool_parser(self, request: ChatCompletionRequest) -> Any:
        """The parser vLLM's chat serving makes for ``request`` (one per request: it keeps stream state)."""
        if not self.can_call_tools:
            return None
        return self._chat._make_parser(request, self._chat.renderer.tokenizer,
                                       self._chat._effective_chat_template_kwargs(request))


def _text_pieces(piece: Any, parser: Any, request: ChatCompletionRequest,
                 prompt_ids: list[int] | None) -> list[ResponsePiece]:
    """One text output of the LLM as the answer's text and (with a tool parser) its function-call pieces."""
    if parser is None:
        return [TextDelta(piece.text, len(piece.token_ids), piece.finish_reason)]
    delta = parser.parse_delta(piece.text, list(piece.token_ids), request, prompt_ids,
                               finished=piece.finish_reason is not None)
    return [TextDelta(getattr(delta, "content", None) or "", len(piece.token_ids), piece.finish_reason),
            *_tool_deltas(delta)]


def vad_factory() -> Any:
    """Silero VAD per session, or None where the ``realtime`` extra is missing (server VAD then refused)."""
    try:
        from omni_engine.realtime.vad import VadConfig, VoiceActivityDetector
    except ImportError:
        return None

    def make(turn: Any) -> Any:
        return VoiceActivityDetector(VadConfig(threshold=turn.threshold, prefix_padding_ms=turn.prefix_padding_ms,
                                               silence_duration_ms=turn.silence_duration_ms))
    return make


@router.websocket("/v1/realtime")
async def realtime(websocket: WebSocket) -> None:
    names = served_names(engine_client(websocket))
    model = websocket.query_params.get("model") or (names or [""])[0]
    engine = PipelineRealtimeEngine(websocket)
    await serve_session(websocket, lambda send: RealtimeSession(engine, send, model=model,
                                                                 vad_factory=vad_factory()))
