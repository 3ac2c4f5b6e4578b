"""One ``/v1/audio/speech/stream`` connection: text in as it is written, audio out sentence by sentence.

Independent of FastAPI (as ``session.py`` is): the route gives it ``speak`` (one text through the
speech stage) and ``send`` (queue a server event on the connection's single writer).

Text is cut with ``SentenceSplitter``'s rule as it arrives, and every complete sentence is submitted
to ``speak`` at once, so several are in flight together and the speech stage batches them; one
*deliverer* task then sends their audio strictly in sentence order. The deliverer sends a sentence's
events with no ``await`` between them, so cancelling it (``input_text.clear``, close) leaves every
sentence either wholly sent or not sent at all.

Each sentence carries the moment its listener needs it (a ``PlaybackClock`` per utterance: the first
now, each later one when the audio sent before it has played at 1x), so the speech stage serves
every connection's most urgent sentence first.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from omni_engine.pipeline.input_processors import SentenceSplitter
from omni_engine.pipeline.playback_clock import PlaybackClock
from omni_engine.realtime.audio_io import StreamResampler, encode_output
from omni_engine.realtime.audio_io import DELTA_MS
from omni_engine.realtime.config import BETA_FORMATS, AudioFormat, validation_error
from omni_engine.realtime.events import EventSession, RealtimeError, error_event, event

logger = logging.getLogger(__name__)

# speak(text, voice, speed, request_id, deadline): the audio of ``text`` and its sample rate.
Speak = Callable[[str, str, float, str, float], Awaitable[tuple[np.ndarray, int]]]



class ClientEvent(str, enum.Enum):
    SESSION_UPDATE = "session.update"
    INPUT_TEXT_APPEND = "input_text.append"
    INPUT_TEXT_COMMIT = "input_text.commit"
    INPUT_TEXT_CLEAR = "input_text.clear"



class StreamConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The session's settings; an update is merged over them and checked as a whole."""

    voice: str = "alloy"
    speed: float = 1.0
    output_audio_format: AudioFormat = msgspec.field(default_factory=AudioFormat)

    def to_json(self, session_id: str) -> dict[str, Any]:
        body = msgspec.to_builtins(self)
        body["output_audio_format"]["rate"] = self.output_audio_format.sample_rate
        return {"id": session_id, "object": "speech.stream.session", **body}


@dataclass
class _Sentence:
    index: int
    text: str
    fmt: AudioFormat  # the session's format when the sentence came: an utterance keeps one format
    task: asyncio.Future[tuple[np.ndarray, int]]
    clock: PlaybackClock  # its utterance's
    piece: int  # its place in the utterance


@dataclass
class _Done:
    """The end of an utterance (``input_text.commit``): ``response.done`` once all before it is sent."""


class SpeechStreamSession(EventSession):
    """State and event handling of one speech stream connection."""

    EVENTS = ClientEvent

    def __init__(self, speak: Speak, send: Callable[[dict[str, Any]], None], *,
                 check_voice: Callable[[str, float], Any]) -> None:
        super().__init__(send)
        self.config = StreamConfig()
        self._speak, self._check_voice = speak, check_voice
        self._splitter = SentenceSplitter([], 0)
        self._next_index = 0
        self._outbox: asyncio.Queue[_Sentence | _Done] = asyncio.Queue()
        self._deliverer: asyncio.Task | None = None
        self._unsent: dict[int, _Sentence] = {}  # submitted, audio not yet sent
        self._utterance = [0, 0]  # sentences and audio ms sent since the last response.done
        self._clock: PlaybackClock | None = None  # the utterance's; a new one after each commit
        self._first_piece = 0  # index of the utterance's first sentence

    async def close(self) -> None:
        """The connection is gone: abort every sentence in flight (their stage requests too) and wait for it."""
        await self._abort()

    # -------------------------------------------------------------- session
    async def _on_session_update(self, body: dict[str, Any]) -> None:
        update = body.get("session")
        if not isinstance(update, dict):
            raise RealtimeError("session must be an object", "invalid_value", "session")
        update = dict(update)
        update.pop("id", None)
        update.pop("object", None)
        fmt = update.get("output_audio_format")
        if isinstance(fmt, str):  # the Realtime beta's names ("pcm16", "g711_ulaw") and bare types
            update["output_audio_format"] = {"type": BETA_FORMATS.get(fmt, fmt)}
        try:
            new = msgspec.convert({**msgspec.to_builtins(self.config), **update}, StreamConfig)
        except msgspec.ValidationError as exc:
            raise validation_error(exc) from None  # EventSession sends it as an error naming the field
        new.output_audio_format.check("output_audio_format")
        try:
            self._check_voice(new.voice, new.speed)
        except ValueError as exc:
            raise RealtimeError(str(exc), "invalid_value",
                                "session.speed" if "speed" in str(exc) else "session.voice") from None
        self.config = new
        self.send(event("session.updated", session=self.config.to_json(self.id)))

    # ----------------------------------------------------------------- text
    async def _on_input_text_append(self, body: dict[str, Any]) -> None:
        text = body.get("text")
        if not isinstance(text, str):
            raise RealtimeError(f"text must be a string, got {type(text).__name__}", "invalid_value", "text")
        for inp in self._splitter.on_output(None, text):  # type: ignore[arg-type]
            self._submit(inp.prompt)

    async def _on_input_text_commit(self, body: dict[str, Any]) -> None:
        for inp in self._splitter.on_finish({}, {}):
            self._submit(inp.prompt)
        self._post(_Done())
        self._clock = None

    async def _on_input_text_clear(self, body: dict[str, Any]) -> None:
        aborted = sorted(self._unsent)
        await self._abort()
        self._splitter = SentenceSplitter([], 0)
        self._utterance = [0, 0]
        self._clock = None
        self.send(event("input_text.cleared", aborted_sentences=aborted))

    # --------------------------------------------------------------- speech
    def _submit(self, text: str) -> None:
        """Speak ``text`` now (concurrently with the sentences before it); its audio is sent in turn."""
        index, self._next_index = self._next_index, self._next_index + 1
        if self._clock is None:
            self._clock, self._first_piece = PlaybackClock(time.time(), self.config.speed), index
        piece = index - self._first_piece
        self._clock.note_input(piece, text)
        task = asyncio.ensure_future(self._speak(text, self.config.voice, self.config.speed,
                                                 f"{self.id}-{index}", self._clock.deadline(piece)))
        self._unsent[index] = sentence = _Sentence(index, text, self.config.output_audio_format, task,
                                                   self._clock, piece)
        self._post(sentence)

    def _post(self, item: _Sentence | _Done) -> None:
        self._outbox.put_nowait(item)
        if self._deliverer is None:
            self._deliverer = asyncio.ensure_future(self._deliver())

    async def _abort(self) -> None:
        """Cancel the deliverer and every sentence not yet sent; nothing of them goes out."""
        tasks = [s.task for s in self._unsent.values()]
        if self._deliverer is not None:
            tasks.append(self._deliverer)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._unsent.clear()
        self._outbox = asyncio.Queue()
        self._deliverer = None

    async def _deliver(self) -> None:
        while True:
            item = await self._outbox.get()
            if isinstance(item, _Done):
                sentences, audio_ms = self._utterance
                self._utterance = [0, 0]
                self.send(event("response.done", sentences=sentences, audio_ms=audio_ms))
                continue
            try:
                audio, rate = await item.task
                # From here to the end of the sentence nothing awaits: it is sent whole or not at all.
                self._unsent.pop(item.index, None)
                self._send_audio(item, audio, rate)
            except Exception as exc:  # noqa: BLE001 - reported; the sentences after it go on
                logger.warning("speech stream %s: sentence %d failed: %s", self.id, item.index, exc)
                self._unsent.pop(item.index, None)
                failed = error_event(RealtimeError(str(exc), "speech_failed", None, "server_error"))
                self.send({**failed, "sentence_index": item.index})

    def _send_audio(self, item: _Sentence, audio: np.ndarray, rate: int) -> None:
        fmt = item.fmt
        # One resampler per sentence, flushed at its end: each sentence's audio is complete on its own.
        resampler = StreamResampler(rate, fmt.sample_rate)
        samples = np.concatenate([resampler.feed(audio), resampler.flush()])
        step = fmt.sample_rate * DELTA_MS // 1000
        for start in range(0, len(samples), step):
            self.send(event("response.output_audio.delta", sentence_index=item.index,
                            delta=encode_output(samples[start:start + step], fmt.type)))
        audio_ms = len(samples) * 1000 // fmt.sample_rate
        item.clock.heard(item.piece, len(samples) / fmt.sample_rate, time.time())
        self._utterance[0] += 1
        self._utterance[1] += audio_ms
        self.send(event("response.sentence.done", sentence_index=item.index, text=item.text, audio_ms=audio_ms))
