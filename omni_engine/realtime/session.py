"""One realtime session: client events in, server events out, the conversation and the turns.

Everything here is per session and lives in the API process; the models run in the pipeline's
stages (``RealtimeEngine``). Events are handled in the order they arrive. Work that takes model
time runs in tasks so that audio keeps flowing while it runs (barge-in needs the VAD to hear
the user while the answer is being spoken): a committed user turn is transcribed in a task, a
response runs in a task that first waits for those transcriptions.

A refused event is answered with an ``error`` event naming the field (OpenAI's shape) and
changes nothing; the session goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from omni_engine.realtime.audio_io import AudioInputError, StreamResampler, decode_input, rate_of
from omni_engine.realtime.config import SessionConfig, SessionConfigError, updated
from omni_engine.realtime.conversation import Conversation, Item, chat_messages, item_from_client, new_id
from omni_engine.realtime.engine import RealtimeEngine, Turn
from omni_engine.realtime.events import ClientEvent, EventSession, RealtimeError, event
from omni_engine.realtime.input_audio import RATE, InputAudio
from omni_engine.realtime.preemptive import PreemptiveAnswer
from omni_engine.realtime.response import ResponseRun, engine_request
from omni_engine.realtime.tools import check_tool_choice, check_tools
from omni_engine.tracing.context import traced

logger = logging.getLogger(__name__)

MIN_COMMIT_MS = 100  # OpenAI refuses to commit less
NO_TOOL_PARSER = ("this server parses no tool calls: it was started without --enable-auto-tool-choice and "
                  "--tool-call-parser (e.g. hermes_json for Qwen2.5)")
# Transcribe a turn once the user's pause is this share of silence_duration_ms (and at least
# EARLY_MIN_MS), before the VAD confirms its end, and start its answer (``PreemptiveAnswer``)
# when the transcript is in: Whisper's time and the LLM's first words then overlap the VAD's
# wait. Speech that resumes discards the guess (its requests are aborted). 125 ms (at the
# default 500) rather than 200 ms: the first audio comes ~0.08 s sooner, for a wasted Whisper run
# (and prefill) at some commas: 3 eSpeak questions made 0, 0, 2 dropped guesses (1, 0, 0 at 200 ms).
EARLY_SHARE, EARLY_MIN_MS = 0.25, 100


class RealtimeSession(EventSession):
    """State and event handling of one ``/v1/realtime`` connection."""

    EVENTS = ClientEvent

    def __init__(self, engine: RealtimeEngine, send: Callable[[dict[str, Any]], None], *, model: str,
                 vad_factory: Callable[[Any], Any] | None) -> None:
        super().__init__(send)
        self.engine = engine
        self.config = SessionConfig(model=model)
        if not engine.can_speak:
            self.config.output_modalities = ["text"]
        if engine.default_voice:
            self.config.audio.output.voice = engine.default_voice
        if engine.hears_audio and not engine.can_hear:
            self.config.audio.input.transcription = None  # the LLM hears the turns; nothing transcribes them
        self._has_vad = vad_factory is not None
        if not self._has_vad:
            self.config.audio.input.turn_detection = None
        self.conversation = Conversation()
        self.response: ResponseRun | None = None
        self._transcriptions: dict[str, asyncio.Task] = {}
        self._input = InputAudio(self.config.audio.input.format.type, self.config.audio.input.turn_detection,
                                 vad_factory)
        self._speech: tuple[str, int] | None = None  # (item id, start sample) while the VAD hears speech
        self._early: tuple[str, int, asyncio.Task] | None = None  # (item id, pause start, transcription)
        self._preempted: tuple[str, int, PreemptiveAnswer] | None = None  # (item id, pause start, answer)
        # The trace of the user's turn being heard (VAD start or commit until its response starts).
        self._turn: Turn | None = None

    async def close(self) -> None:
        """The connection is gone: end the response and the transcriptions (their stage requests are aborted)."""
        if self.response is not None:
            await self.response.cancel("client_cancelled")
        tasks = list(self._transcriptions.values()) + ([self._early[2]] if self._early else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._preempted is not None:
            await self._preempted[2].aclose()
        self._end_turn("unanswered")

    # -------------------------------------------------------------- session
    async def _on_session_update(self, body: dict[str, Any]) -> None:
        new = updated(self.config, body.get("session"))
        if "audio" in new.output_modalities and not self.engine.can_speak:
            raise SessionConfigError("this pipeline has no speech stage: output_modalities must be ['text']",
                                     "session.output_modalities")
        if new.audio.input.turn_detection is not None and not self._has_vad:
            raise SessionConfigError("server_vad needs the realtime extra (pip install silero-vad); set "
                                     "turn_detection to null and commit the audio yourself",
                                     "session.audio.input.turn_detection")
        self._check_tools(new.tools, new.tool_choice, "session")
        self.engine.check_voice(new.audio.output.voice, new.audio.output.speed)
        if new.audio.input.transcription is not None:
            if not self.engine.can_hear and self.engine.hears_audio:
                raise SessionConfigError("this pipeline has no speech-to-text stage (its LLM hears each turn "
                                         "itself): set audio.input.transcription to null",
                                         "session.audio.input.transcription")
            self.engine.check_language(new.audio.input.transcription.language)
        old_in = self.config.audio.input
        self.config = new
        if (new.audio.input.format, new.audio.input.turn_detection) != (old_in.format, old_in.turn_detection):
            self._input.configure(new.audio.input.format.type, new.audio.input.turn_detection)
            self._speech = None
        self.send(event("session.updated", session=self.config.to_json(self.id)))

    # ---------------------------------------------------------- input audio
    async def _on_input_audio_buffer_append(self, body: dict[str, Any]) -> None:
        try:
            samples = decode_input(body.get("audio"), self._input.fmt)
            events = self._input.append(samples)
        except AudioInputError as exc:
            raise RealtimeError(f"{exc} (session format {self._input.fmt})", "invalid_value", "audio") from None
        except OverflowError as exc:
            raise RealtimeError(str(exc), "input_audio_buffer_full", "audio") from None
        for kind, sample in events:
            if kind == "started":
                await self._speech_started(sample)
            else:
                self._speech_stopped(sample)
        self._transcribe_early()

    def _transcribe_early(self) -> None:
        """Start transcribing the turn once its pause is long enough (``EARLY_SHARE``); drop the guess when
        speech resumes (the trailing silence the final turn adds does not change Whisper's text)."""
        pause = self._input.pause_start()
        if self._early is not None and (self._speech is None or self._early[:2] != (self._speech[0], pause)):
            self._early[2].cancel()
            self._early = None
            self._drop_preempted()
        if (self._early is None and self._speech is not None and pause is not None and self.engine.can_hear
                and not self.engine.hears_audio  # (its answer hears the audio, not a transcript)
                and self._input.total - pause >= max(EARLY_MIN_MS * RATE // 1000,
                                                     int(EARLY_SHARE * self._input.silence_samples()))):
            item_id, start = self._speech
            audio = self._input.peek(start, self._input.total)
            # Padded with zeros to the turn the VAD would commit at this pause: Whisper hears a guess
            # with as much trailing silence as the turn itself (tiny.en's words can change with it).
            missing = pause + self._input.silence_samples() - self._input.total
            if missing > 0:
                audio = np.concatenate((audio, np.zeros(missing, dtype=audio.dtype)))
            # The pause's offset in the id: a dropped guess's request may still be aborting in the stages.
            task = asyncio.ensure_future(traced(self._turn_headers(),
                                                self._recognize(audio, f"{item_id}-stt-early-{pause}")))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a dropped guess's error is moot
            task.add_done_callback(lambda t, key=(item_id, pause): self._preempt(key, t))
            self._early = (item_id, pause, task)

    def _preempt(self, key: tuple[str, int], transcription: asyncio.Task) -> None:
        """The early transcript of the turn ``key`` is in: start the answer the VAD's end of the turn
        would start (the same request, built the same way), unless anything would make it differ."""
        turn = self.config.audio.input.turn_detection
        if (self._early is None or self._early[:2] != key or transcription.cancelled() or transcription.exception()
                or not transcription.result().strip() or turn is None or not turn.create_response
                or (self.response is not None and not self.response.done) or self._transcriptions):
            return
        self._drop_preempted()
        item_id = key[0]
        heard = Item(id=item_id, role="user",
                     content=[{"type": "input_audio", "transcript": transcription.result()}])
        messages = chat_messages([*self.conversation.items, heard], self.config.instructions)
        answer = PreemptiveAnswer(self.engine, engine_request(self.config, {}, messages),
                                  f"{item_id}-preempted-{key[1]}", self._turn_headers())
        if self._turn is not None:
            self._turn.event("answer_started_early")
        self._preempted = (item_id, key[1], answer)

    def _drop_preempted(self) -> None:
        if self._preempted is not None:
            self._preempted[2].cancel()
            self._preempted = None

    async def _speech_started(self, sample: int) -> None:
        item_id = new_id("item")
        self._speech = (item_id, sample)
        self._start_turn(item_id, "speech_started")
        self.send(event("input_audio_buffer.speech_started", audio_start_ms=sample * 1000 // RATE, item_id=item_id))
        turn = self.config.audio.input.turn_detection
        if turn is not None and turn.interrupt_response and self.response is not None and not self.response.done:
            if self.response.turn is not None:
                self.response.turn.event("barge_in")
            await self.response.cancel("turn_detected")  # barge-in

    def _speech_stopped(self, sample: int) -> None:
        item_id, start = self._speech or (new_id("item"), self._input.total)
        self._speech = None
        if self._turn is None:
            self._start_turn(item_id)
        self._turn_event("vad_stop")
        early = None
        if self._early is not None and self._early[:2] == (item_id, sample - self._input.silence_samples()):
            early = self._early[2]  # the pause that ended the turn is the one already being transcribed
            self._early = None
        preempted = None
        if early is not None and self._preempted is not None and self._preempted[0] == item_id:
            preempted = self._preempted[2]  # the answer to that transcript (the same pause)
            self._preempted = None
        self._drop_preempted()
        self.send(event("input_audio_buffer.speech_stopped", audio_end_ms=sample * 1000 // RATE, item_id=item_id))
        self._commit(self._input.take(start, sample), item_id, early)
        turn = self.config.audio.input.turn_detection
        if turn is not None and turn.create_response and (self.response is None or self.response.done):
            self._start_response({}, preempted)
        elif preempted is not None:
            preempted.cancel()

    async def _on_input_audio_buffer_commit(self, body: dict[str, Any]) -> None:
        buffered_ms = self._input.buffered * 1000 // RATE
        if buffered_ms < MIN_COMMIT_MS:
            raise RealtimeError(f"buffer too small. Expected at least {MIN_COMMIT_MS}ms of audio, but buffer only "
                                f"has {buffered_ms}ms of audio.", "input_audio_buffer_commit_empty")
        item_id = self._speech[0] if self._speech else new_id("item")
        if self._turn is None:
            self._start_turn(item_id)
        self._turn_event("committed")
        audio = self._input.take()
        if self._speech is not None:  # a manual commit ends the VAD's turn too
            self._speech = None
            self._input.configure(self._input.fmt, self._input.turn)
            self._transcribe_early()  # drops a guess at this turn's end
        self._commit(audio, item_id)

    async def _on_input_audio_buffer_clear(self, body: dict[str, Any]) -> None:
        self._input.clear()
        self._speech = None
        self._transcribe_early()
        self.send(event("input_audio_buffer.cleared"))

    def _commit(self, audio: np.ndarray, item_id: str, early: asyncio.Task | None = None) -> None:
        item = Item(id=item_id, role="user", content=[{"type": "input_audio", "transcript": None}])
        previous = self.conversation.add(item)
        self.send(event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id))
        self._announce(item, previous)
        self._heard(item, audio, early)

    def _heard(self, item: Item, audio: np.ndarray, early: asyncio.Task | None = None) -> None:
        """A user's audio: kept for an LLM that hears it, transcribed where the session asks for it
        (or the LLM reads transcripts)."""
        if self.engine.hears_audio:
            item.audio = audio
            if self.config.audio.input.transcription is None or not self.engine.can_hear:
                self.send(event("conversation.item.done", item=item.to_json()))
                return
        self._transcribe(item, audio, early)

    def _announce(self, item: Item, previous: str | None) -> None:
        for kind in ("conversation.item.added", "conversation.item.created"):
            self.send(event(kind, previous_item_id=previous, item=item.to_json()))

    def _transcribe(self, item: Item, audio: np.ndarray, early: asyncio.Task | None = None) -> None:
        task = asyncio.ensure_future(traced(self._turn_headers(),
                                            self._run_transcription(item, audio, early, self._turn)))
        self._transcriptions[item.id] = task
        task.add_done_callback(lambda _t, key=item.id: self._transcriptions.pop(key, None))

    async def _recognize(self, audio: np.ndarray, request_id: str) -> str:
        if not self.engine.can_hear:
            raise ValueError("this pipeline has no speech-to-text stage: audio input cannot be understood")
        settings = self.config.audio.input.transcription
        return await self.engine.transcribe(audio, language=settings.language if settings else None,
                                            prompt=settings.prompt if settings else None, request_id=request_id)

    async def _run_transcription(self, item: Item, audio: np.ndarray, early: asyncio.Task | None,
                                 turn: Turn | None) -> None:
        settings = self.config.audio.input.transcription
        try:
            text = await (early if early is not None else self._recognize(audio, f"{item.id}-stt"))
        except asyncio.CancelledError:
            if early is not None:
                early.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the client; the session goes on
            logger.warning("realtime transcription of %s failed: %s", item.id, exc)
            self.send(event("conversation.item.input_audio_transcription.failed", item_id=item.id, content_index=0,
                            error={"type": "transcription_error", "code": type(exc).__name__,
                                   "message": str(exc), "param": None}))
            return
        item.content[0]["transcript"] = text
        if turn is not None:
            turn.event("transcript_ready")
        if settings is not None:
            self.send(event("conversation.item.input_audio_transcription.completed", item_id=item.id,
                            content_index=0, transcript=text,
                            usage={"type": "duration", "seconds": round(len(audio) / RATE, 3)}))
        self.send(event("conversation.item.done", item=item.to_json()))

    # --------------------------------------------------------- conversation
    async def _on_conversation_item_create(self, body: dict[str, Any]) -> None:
        item = item_from_client(body.get("item"))
        audio_parts = [(i, p) for i, p in enumerate(item.content) if p.get("type") == "input_audio"]
        decoded = []
        for i, part in audio_parts:
            if part.get("transcript"):
                continue
            try:
                samples = decode_input(part.get("audio"), self._input.fmt)
            except AudioInputError as exc:
                raise RealtimeError(f"item.content[{i}].audio: {exc}", "invalid_value",
                                    f"item.content[{i}].audio") from None
            resampler = StreamResampler(rate_of(self._input.fmt), RATE)
            decoded.append(np.concatenate([resampler.feed(samples), resampler.flush()]))
        if len(decoded) > 1:
            raise RealtimeError("an item holds one input_audio part without a transcript", "invalid_value",
                                "item.content")
        for _, part in audio_parts:
            part.pop("audio", None)  # not kept: the transcript is what the conversation uses
            part.setdefault("transcript", None)
        previous = self.conversation.add(item, body.get("previous_item_id"))
        self._announce(item, previous)
        if decoded:
            self._heard(item, decoded[0])
        else:
            self.send(event("conversation.item.done", item=item.to_json()))

    async def _on_conversation_item_retrieve(self, body: dict[str, Any]) -> None:
        item = self.conversation.get(body.get("item_id"))
        if item is None:
            raise RealtimeError(f"item {body.get('item_id')!r} is not in the conversation", "item_not_found",
                                "item_id")
        self.send(event("conversation.item.retrieved", item=item.to_json()))

    async def _on_conversation_item_delete(self, body: dict[str, Any]) -> None:
        self.conversation.delete(body.get("item_id"))
        self.send(event("conversation.item.deleted", item_id=body.get("item_id")))

    async def _on_conversation_item_truncate(self, body: dict[str, Any]) -> None:
        for name in ("content_index", "audio_end_ms"):
            if not isinstance(body.get(name), int):
                raise RealtimeError(f"{name} must be an integer", "invalid_value", name)
        self.conversation.truncate(body.get("item_id"), body["content_index"], body["audio_end_ms"])
        self.send(event("conversation.item.truncated", item_id=body["item_id"], content_index=body["content_index"],
                        audio_end_ms=body["audio_end_ms"]))

    # ------------------------------------------------------------ responses
    async def _on_response_create(self, body: dict[str, Any]) -> None:
        if self.response is not None and not self.response.done:
            raise RealtimeError(f"Conversation already has an active response in progress: {self.response.id}. "
                                "Wait until the response is finished before creating a new one.",
                                "conversation_already_has_active_response")
        options = body.get("response") or {}
        if not isinstance(options, dict):
            raise RealtimeError("response must be an object", "invalid_value", "response")
        self._start_response(self._response_options(options))

    def _response_options(self, options: dict[str, Any]) -> dict[str, Any]:
        known = {"output_modalities", "modalities", "instructions", "max_output_tokens",
                 "max_response_output_tokens", "conversation", "input", "metadata", "audio", "tool_choice", "tools"}
        if unknown := sorted(set(options) - known):
            raise RealtimeError(f"Unknown parameter: 'response.{unknown[0]}'.", "unknown_parameter",
                                f"response.{unknown[0]}")
        checked = dict(options)
        if "modalities" in checked:
            checked.setdefault("output_modalities", checked.pop("modalities"))
        if "max_response_output_tokens" in checked:
            checked.setdefault("max_output_tokens", checked.pop("max_response_output_tokens"))
        mods = checked.get("output_modalities")
        if mods is not None:
            if not isinstance(mods, list) or not mods or not set(mods) <= {"text", "audio"}:
                raise RealtimeError("response.output_modalities must be ['audio'] or ['text']", "invalid_value",
                                    "response.output_modalities")
            checked["output_modalities"] = ["audio"] if "audio" in mods else ["text"]
            if "audio" in mods and not self.engine.can_speak:
                raise RealtimeError("this pipeline has no speech stage: use output_modalities ['text']",
                                    "invalid_value", "response.output_modalities")
        tokens = checked.get("max_output_tokens")
        if tokens is not None and tokens != "inf" and (not isinstance(tokens, int) or not 1 <= tokens <= 4096):
            raise RealtimeError(f"response.max_output_tokens must be in [1, 4096] or 'inf', got {tokens!r}",
                                "invalid_value", "response.max_output_tokens")
        if checked.get("conversation", "auto") not in ("auto", "none"):
            raise RealtimeError("response.conversation must be 'auto' or 'none'", "invalid_value",
                                "response.conversation")
        if "tools" in checked or "tool_choice" in checked:
            self._check_tools(checked.get("tools", self.config.tools),
                              checked.get("tool_choice", self.config.tool_choice), "response")
        if "input" in checked:
            checked["input"] = self._response_input(checked["input"])
        return checked

    def _check_tools(self, tools: Any, tool_choice: Any, where: str) -> None:
        check_tools(tools, where)
        check_tool_choice(tool_choice, tools, where)
        if tools and not self.engine.can_call_tools:
            raise SessionConfigError(NO_TOOL_PARSER, f"{where}.tools")

    def _response_input(self, items: Any) -> list[Item]:
        if not isinstance(items, list):
            raise RealtimeError("response.input must be a list of items", "invalid_value", "response.input")
        resolved = []
        for i, body in enumerate(items):
            if isinstance(body, dict) and body.get("type") == "item_reference":
                item = self.conversation.get(body.get("id"))
                if item is None:
                    raise RealtimeError(f"response.input[{i}] refers to unknown item {body.get('id')!r}",
                                        "invalid_value", f"response.input[{i}].id")
                resolved.append(item)
            else:
                resolved.append(item_from_client(body))
        return resolved

    def _start_response(self, options: dict[str, Any], preempted: PreemptiveAnswer | None = None) -> None:
        # The turn it answers (a response.create with no turn heard is a turn of its own).
        turn, self._turn = self._turn or self.engine.start_turn(None), None
        run = ResponseRun(engine=self.engine, config=self.config, conversation=self.conversation, send=self.send,
                          options=options, wait_for=list(self._transcriptions.values()), preempted=preempted,
                          turn=turn)
        self.response = run
        run.start()

    # ------------------------------------------------------------- traces
    def _start_turn(self, item_id: str | None, first_event: str | None = None) -> None:
        """Trace a new user turn; one still open (heard, never answered) ends first."""
        self._end_turn("unanswered")
        self._turn = self.engine.start_turn(item_id)
        if first_event is not None:
            self._turn_event(first_event)

    def _end_turn(self, status: str) -> None:
        if self._turn is not None:
            self._turn.end(status)
            self._turn = None

    def _turn_event(self, name: str) -> None:
        if self._turn is not None:
            self._turn.event(name)

    def _turn_headers(self) -> dict[str, str] | None:
        return self._turn.headers if self._turn is not None else None

    async def _on_response_cancel(self, body: dict[str, Any]) -> None:
        wanted = body.get("response_id")
        if self.response is None or self.response.done or (wanted and wanted != self.response.id):
            raise RealtimeError("Cancellation failed: no active response found", "response_cancel_not_active")
        await self.response.cancel("client_cancelled")
