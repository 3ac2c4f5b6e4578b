"""A realtime session's conversation: its items in order, and the chat messages they make for the LLM.

Items are kept as OpenAI sends them back (``realtime.item``: messages with content parts,
function calls and their outputs). The LLM reads text: a user's audio counts through its
transcript, an assistant's audio through the transcript of what was actually spoken; an LLM that
hears (``hears_audio``) gets a user's audio itself, as an ``input_audio`` part of a float WAV. Each
spoken sentence's length is kept so ``conversation.item.truncate`` (the client stopped playback
at ``audio_end_ms``) can cut the transcript to the sentences that were heard.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_engine.audio import wav_float_bytes
from omni_engine.realtime.config import SessionConfigError
from omni_engine.realtime.input_audio import RATE

USER_PARTS = ("input_text", "input_audio", "text")
ASSISTANT_PARTS = ("output_text", "output_audio", "text", "audio")
ROLES = ("user", "assistant", "system")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass
class Item:
    """One conversation item; ``spoken`` is (sentence, audio ms) per sentence of an assistant's audio."""

    id: str
    type: str = "message"
    role: str | None = None
    status: str = "completed"
    content: list[dict[str, Any]] = field(default_factory=list)
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    spoken: list[tuple[str, float]] = field(default_factory=list)
    # A user's audio (16 kHz float32 mono), kept for an LLM that hears it; never sent back.
    audio: np.ndarray | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status}
        if self.type == "message":
            body.update(role=self.role, content=[dict(part) for part in self.content])
        elif self.type == "function_call":
            body.update(call_id=self.call_id, name=self.name, arguments=self.arguments)
        else:
            body.update(call_id=self.call_id, output=self.output)
        return body

    def text(self) -> str:
        """What the LLM reads of this item."""
        pieces = [part.get("text") or part.get("transcript") or "" for part in self.content]
        return " ".join(p.strip() for p in pieces if p and p.strip())


def item_from_client(body: Any) -> Item:
    """A ``conversation.item.create`` item, checked; ``SessionConfigError`` names the field at fault."""
    if not isinstance(body, dict):
        raise SessionConfigError("item must be an object", "item")
    kind = body.get("type", "message")
    item = Item(id=body.get("id") or new_id("item"), type=kind)
    if kind in ("function_call", "function_call_output"):
        fields = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
        for name in fields:
            if not isinstance(body.get(name), str):
                raise SessionConfigError(f"a {kind} item needs a string {name}", f"item.{name}")
        for name in fields:
            setattr(item, name, body[name])
        return item
    if kind != "message":
        raise SessionConfigError(f"item type {kind!r} is not supported; use 'message', 'function_call' or "
                                 "'function_call_output'", "item.type")
    role = body.get("role")
    if role not in ROLES:
        raise SessionConfigError(f"item.role must be one of {list(ROLES)}, got {role!r}", "item.role")
    content = body.get("content")
    if not isinstance(content, list) or not content:
        raise SessionConfigError("item.content must be a non-empty list of content parts", "item.content")
    allowed = ASSISTANT_PARTS if role == "assistant" else USER_PARTS
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in allowed:
            got = part.get("type") if isinstance(part, dict) else part
            raise SessionConfigError(f"item.content[{i}].type must be one of {list(allowed)} for role {role!r}, "
                                     f"got {got!r}", f"item.content[{i}].type")
        if part["type"] in ("input_text", "output_text", "text") and not isinstance(part.get("text"), str):
            raise SessionConfigError(f"item.content[{i}].text must be a string", f"item.content[{i}].text")
    item.role = role
    item.content = [dict(part) for part in content]
    return item


class Conversation:
    """The items of one session, in order."""

    def __init__(self) -> None:
        self.items: list[Item] = []

    def get(self, item_id: str) -> Item | None:
        return next((item for item in self.items if item.id == item_id), None)

    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert ``item`` after ``previous_item_id`` (``root`` = first; none = last); returns the id before it."""
        if self.get(item.id) is not None:
            raise SessionConfigError(f"an item with id {item.id!r} already exists", "item.id")
        if previous_item_id is None:
            before = self.last_id()
            self.items.append(item)
            return before
        if previous_item_id == "root":
            self.items.insert(0, item)
            return None
        for i, existing in enumerate(self.items):
            if existing.id == previous_item_id:
                self.items.insert(i + 1, item)
                return previous_item_id
        raise SessionConfigError(f"previous_item_id {previous_item_id!r} is not in the conversation",
                                 "previous_item_id")

    def delete(self, item_id: str) -> None:
        item = self.get(item_id)
        if item is None:
            raise SessionConfigError(f"item {item_id!r} is not in the conversation", "item_id")
        self.items.remove(item)

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        """Keep of an assistant's audio item what was heard by ``audio_end_ms`` (whole sentences)."""
        item = self.get(item_id)
        if item is None or item.role != "assistant":
            raise SessionConfigError(f"item {item_id!r} is not an assistant item of this conversation", "item_id")
        if not 0 <= content_index < len(item.content) or item.content[content_index].get("type") != "output_audio":
            raise SessionConfigError(f"content_index {content_index} is not an audio part of item {item_id!r}",
                                     "content_index")
        total = sum(ms for _, ms in item.spoken)
        if audio_end_ms < 0 or audio_end_ms > total + 1:
            raise SessionConfigError(f"audio_end_ms {audio_end_ms} is outside the item's audio (0..{total:.0f} ms)",
                                     "audio_end_ms")
        heard, elapsed = [], 0.0
        for sentence, ms in item.spoken:
            if elapsed + ms > audio_end_ms + 1:
                break
            heard.append(sentence)
            elapsed += ms
        item.spoken = item.spoken[:len(heard)]
        item.content[content_index]["transcript"] = " ".join(heard)

    def chat_messages(self, instructions: str, hears_audio: bool = False) -> list[dict[str, Any]]:
        """The conversation as chat messages: instructions first, empty messages left out. Function calls
        join the assistant message before them (or make one) as ``tool_calls``; an output is a ``tool``
        message. ``hears_audio``: a user's audio is an ``input_audio`` part, its transcript unused."""
        return chat_messages(self.items, instructions, hears_audio)


def heard_content(item: Item) -> list[dict[str, Any]]:
    """A user item with audio as an LLM that hears takes it: the audio (float WAV: nothing is lost
    to 16-bit samples) and the item's text parts."""
    assert item.audio is not None
    data = base64.b64encode(wav_float_bytes(item.audio, RATE)).decode()
    texts = [{"type": "text", "text": part["text"]} for part in item.content if part.get("text")]
    return [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}, *texts]


def chat_messages(items: list[Item], instructions: str, hears_audio: bool = False) -> list[dict[str, Any]]:
    """``Conversation.chat_messages`` of ``items``."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output or ""})
        elif hears_audio and item.audio is not None:
            messages.append({"role": item.role or "user", "content": heard_content(item)})
        elif text := item.text():
            messages.append({"role": item.role or "user", "content": text})
    return messages
