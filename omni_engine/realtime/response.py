"""One model response of a realtime session: its events, from ``response.created`` to ``response.done``.

A response runs as a task. Cancelling it (``response.cancel``, or barge-in when the user starts
speaking) cancels the task: leaving the engine's generator aborts the request on every stage, and
the ``done`` events go out at once with status ``cancelled``; nothing of the response is sent
after them. The assistant item keeps, of an audio answer, the sentences whose audio was sent.

A response's outputs are opened as they appear: the assistant message at its first text or audio,
a ``function_call`` item at each call the LLM writes (with tools); a response that only calls a
function has no message, as with OpenAI.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from omni_engine.pipeline.input_processors import split_sentences
from omni_engine.realtime.audio_io import DELTA_MS, StreamResampler, encode_output
from omni_engine.realtime.config import SessionConfig
from omni_engine.realtime.conversation import Conversation, Item, chat_messages, new_id
from omni_engine.realtime.engine import AudioChunk, FunctionCallDelta, RealtimeEngine, ResponseStart, TextDelta, Turn
from omni_engine.realtime.events import event
from omni_engine.realtime.preemptive import PreemptiveAnswer
from omni_engine.realtime.tools import chat_tool_choice, chat_tools
from omni_engine.tracing.context import traced

logger = logging.getLogger(__name__)


def engine_request(config: SessionConfig, options: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``RealtimeEngine.respond`` is asked for a response with ``options`` (but its request id):
    one place, so that a preemptive answer is adopted exactly when it is the same request."""
    out = config.audio.output
    max_tokens = options.get("max_output_tokens", config.max_output_tokens)
    return {"messages": messages, "audio": "audio" in (options.get("output_modalities") or config.output_modalities),
            "voice": out.voice, "speed": out.speed, "max_tokens": None if max_tokens == "inf" else int(max_tokens),
            "temperature": config.temperature, "tools": chat_tools(options.get("tools", config.tools)),
            "tool_choice": chat_tool_choice(options.get("tool_choice", config.tool_choice))}


class ResponseRun:
    """A response in flight; ``task`` runs it, ``cancel`` ends it with status ``cancelled``."""

    def __init__(self, *, engine: RealtimeEngine, config: SessionConfig, conversation: Conversation,
                 send: Callable[[dict[str, Any]], None], options: dict[str, Any],
                 wait_for: list[asyncio.Future], preempted: PreemptiveAnswer | None = None,
                 turn: Turn | None = None) -> None:
        """``turn``: the trace of the turn it answers (None: not traced)."""
        self.id = new_id("resp")
        self.engine, self.config, self.conversation, self.send = engine, config, conversation, send
        self.options = options
        self.modalities: list[str] = options.get("output_modalities") or list(config.output_modalities)
        self.audio = "audio" in self.modalities
        self.in_conversation = options.get("conversation", "auto") != "none"
        # The assistant message, opened at its first text or audio; function calls by the LLM's index.
        self.item = Item(id=new_id("item"), role="assistant", status="in_progress",
                         content=[{"type": "output_audio" if self.audio else "output_text",
                                   **({"transcript": ""} if self.audio else {"text": ""})}])
        self.calls: dict[int, Item] = {}
        self.outputs: list[Item] = []  # in the order they were opened: their output_index
        self._wait_for = wait_for
        self._preempted = preempted  # the answer already running, if it is this response's request
        self.text = ""
        self.prompt_tokens = self.output_tokens = 0
        self.cancel_reason: str | None = None
        self.task: asyncio.Task | None = None
        self.turn = turn
        if turn is not None:
            turn.set("response_id", self.id)

    def start(self) -> None:
        self.send(event("response.created", response=self._json("in_progress")))
        self.task = asyncio.ensure_future(traced(self.turn.headers if self.turn is not None else None, self._run()))

    @property
    def done(self) -> bool:
        return self.task is None or self.task.done()

    async def cancel(self, reason: str) -> None:
        """End the response now (``turn_detected`` or ``client_cancelled``); returns once ``response.done`` is queued."""
        if self.done:
            return
        self.cancel_reason = reason
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    # ------------------------------------------------------------ running
    def _part(self) -> dict[str, Any]:
        return self.item.content[0]

    def _ids(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": self._index(self.item),
                "content_index": 0}

    def _index(self, item: Item) -> int:
        return next(i for i, out in enumerate(self.outputs) if out is item)

    async def _run(self) -> None:
        status, details = "completed", None
        try:
            if self._wait_for:  # the user's audio turns still being transcribed: the LLM needs their text
                await asyncio.wait(self._wait_for)  # not gather: cancelling us must not cancel them
            messages = self._messages()
            finish = await self._stream(messages)
            if finish == "length":
                status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        except asyncio.CancelledError:
            status, details = "cancelled", {"type": "cancelled", "reason": self.cancel_reason or "client_cancelled"}
        except Exception as exc:  # noqa: BLE001 - reported to the client as a failed response
            logger.warning("realtime response %s failed: %s", self.id, exc)
            status = "failed"
            details = {"type": "failed", "error": {"type": "invalid_request_error" if isinstance(exc, ValueError)
                                                   else "server_error", "code": type(exc).__name__,
                                                   "message": str(exc)}}
            self.send(event("error", error={"type": details["error"]["type"], "code": "response_failed",
                                            "message": f"response {self.id}: {exc}", "param": None,
                                            "event_id": None}))
        finally:
            if self._preempted is not None and not self._preempted.adopted:
                self._preempted.cancel()  # ended before it could take the answer
        self._finish(status, details)

    def _messages(self) -> list[dict[str, Any]]:
        instructions = self.options.get("instructions") or self.config.instructions
        if self.in_conversation and "input" not in self.options:
            return self.conversation.chat_messages(instructions, self.engine.hears_audio)
        return chat_messages(list(self.options.get("input") or ()), instructions)

    def _open(self, item: Item) -> None:
        """``item`` becomes the response's next output (and the conversation's last item)."""
        previous = self.conversation.last_id()
        if self.in_conversation:
            self.conversation.add(item)
        self.outputs.append(item)
        self.send(event("response.output_item.added", response_id=self.id, output_index=len(self.outputs) - 1,
                        item=item.to_json()))
        if self.in_conversation:
            for kind in ("conversation.item.added", "conversation.item.created"):
                self.send(event(kind, previous_item_id=previous, item=item.to_json()))

    def _open_message(self) -> None:
        if any(out is self.item for out in self.outputs):
            return
        self._open(self.item)
        part = {"type": "audio", "transcript": ""} if self.audio else {"type": "text", "text": ""}
        self.send(event("response.content_part.added", **self._ids(), part=part))

    def _call_delta(self, piece: FunctionCallDelta) -> None:
        call = self.calls.get(piece.index)
        if call is None:
            call = Item(id=new_id("item"), type="function_call", status="in_progress",
                        call_id=piece.call_id or new_id("call"), name=piece.name or "", arguments="")
            self.calls[piece.index] = call
            self._open(call)
        if piece.arguments:
            call.arguments = (call.arguments or "") + piece.arguments
            self.send(event("response.function_call_arguments.delta", response_id=self.id, item_id=call.id,
                            output_index=self._index(call), call_id=call.call_id, delta=piece.arguments))

    async def _stream(self, messages: list[dict[str, str]]) -> str | None:
        out = self.config.audio.output
        resampler: StreamResampler | None = None
        finish = None
        sentences_spoken = 0
        request = engine_request(self.config, self.options, messages)
        pieces = self._preempted.adopt(request) if self._preempted is not None else None
        if pieces is None:
            pieces = self.engine.respond(**request, request_id=self.id)
        try:
            async for piece in pieces:
                if isinstance(piece, ResponseStart):
                    self.prompt_tokens = piece.prompt_tokens
                elif isinstance(piece, TextDelta):
                    self.output_tokens += piece.tokens
                    finish = piece.finish_reason or finish
                    if piece.text:
                        if self.turn is not None:
                            self.turn.event("first_word")
                        self._open_message()
                        self.text += piece.text
                        kind = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
                        self.send(event(kind, **self._ids(), delta=piece.text))
                        if not self.audio:
                            self._part()["text"] = self.text
                elif isinstance(piece, FunctionCallDelta):
                    self._call_delta(piece)
                elif isinstance(piece, AudioChunk) and len(piece.samples):
                    if self.turn is not None:
                        self.turn.event("first_audio")
                    self._open_message()
                    resampler = resampler or StreamResampler(piece.rate, out.format.sample_rate)
                    samples = resampler.feed(np.asarray(piece.samples, dtype=np.float32))
                    self._send_audio(samples)
                    sentence = piece.text
                    if sentence is None:  # a speech stage that does not say: sentences, as spoken_sentences cuts
                        sentences = split_sentences(self.text)
                        sentence = sentences[sentences_spoken] if sentences_spoken < len(sentences) else ""
                    sentences_spoken += 1
                    self.item.spoken.append((sentence, 1000.0 * len(piece.samples) / piece.rate))
                    self._part()["transcript"] = " ".join(s for s, _ in self.item.spoken)
            if resampler is not None:
                self._send_audio(resampler.flush())
        finally:
            await pieces.aclose()
        if self.audio and sentences_spoken == 0 and self.text:
            self._part()["transcript"] = self.text  # no audio came (e.g. nothing speakable): keep the text
        return finish

    def _send_audio(self, samples: np.ndarray) -> None:
        if not len(samples):
            return
        fmt = self.config.audio.output.format
        step = fmt.sample_rate * DELTA_MS // 1000
        for start in range(0, len(samples), step):
            self.send(event("response.output_audio.delta", **self._ids(),
                            delta=encode_output(samples[start:start + step], fmt.type)))

    def _finish(self, status: str, details: dict[str, Any] | None) -> None:
        # An item the client deleted meanwhile is not sent again.
        kept = [item for item in self.outputs if not self.in_conversation or self.conversation.get(item.id)]
        for item in kept:
            item.status = "completed" if status == "completed" else "incomplete"
            if item is self.item:
                self._finish_message()
            else:
                self.send(event("response.function_call_arguments.done", response_id=self.id, item_id=item.id,
                                output_index=self._index(item), call_id=item.call_id, name=item.name,
                                arguments=item.arguments))
            self.send(event("response.output_item.done", response_id=self.id, output_index=self._index(item),
                            item=item.to_json()))
            if self.in_conversation:
                self.send(event("conversation.item.done", item=item.to_json()))
        self.send(event("response.done", response=self._json(status, details, kept)))
        if self.turn is not None:
            self.turn.end(status)

    def _finish_message(self) -> None:
        part = self._part()
        if self.audio:
            self.send(event("response.output_audio.done", **self._ids()))
            self.send(event("response.output_audio_transcript.done", **self._ids(),
                            transcript=part.get("transcript", "")))
            done_part = {"type": "audio", "transcript": part.get("transcript", "")}
        else:
            self.send(event("response.output_text.done", **self._ids(), text=part.get("text", "")))
            done_part = {"type": "text", "text": part.get("text", "")}
        self.send(event("response.content_part.done", **self._ids(), part=done_part))

    def _json(self, status: str, details: dict[str, Any] | None = None,
              output: list[Item] | None = None) -> dict[str, Any]:
        out = self.config.audio.output
        usage = None
        if status != "in_progress":
            usage = {"total_tokens": self.prompt_tokens + self.output_tokens, "input_tokens": self.prompt_tokens,
                     "output_tokens": self.output_tokens,
                     "input_token_details": {"text_tokens": self.prompt_tokens, "audio_tokens": 0,
                                             "cached_tokens": 0},
                     "output_token_details": {"text_tokens": self.output_tokens, "audio_tokens": 0}}
        return {"id": self.id, "object": "realtime.response", "status": status, "status_details": details,
                "output": [item.to_json() for item in output or ()],
                "conversation_id": "auto" if self.in_conversation else None,
                "output_modalities": self.modalities,
                "audio": {"output": {"format": {"type": out.format.type, "rate": out.format.sample_rate},
                                     "voice": out.voice}},
                "max_output_tokens": self.options.get("max_output_tokens", self.config.max_output_tokens),
                "metadata": self.options.get("metadata"), "usage": usage}
