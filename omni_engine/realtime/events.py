"""Realtime API events: the client event types this server takes, server events, OpenAI's error shape."""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Callable
from typing import Any

from omni_engine.realtime.config import SessionConfigError


class ClientEvent(str, enum.Enum):
    SESSION_UPDATE = "session.update"
    INPUT_AUDIO_BUFFER_APPEND = "input_audio_buffer.append"
    INPUT_AUDIO_BUFFER_COMMIT = "input_audio_buffer.commit"
    INPUT_AUDIO_BUFFER_CLEAR = "input_audio_buffer.clear"
    CONVERSATION_ITEM_CREATE = "conversation.item.create"
    CONVERSATION_ITEM_RETRIEVE = "conversation.item.retrieve"
    CONVERSATION_ITEM_TRUNCATE = "conversation.item.truncate"
    CONVERSATION_ITEM_DELETE = "conversation.item.delete"
    RESPONSE_CREATE = "response.create"
    RESPONSE_CANCEL = "response.cancel"



class RealtimeError(Exception):
    """A client event refused: sent back as an ``error`` event; the session goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None,
                 err_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code, self.param, self.err_type = code, param, err_type


def event(kind: str, **fields: Any) -> dict[str, Any]:
    """A server event with its own ``event_id``."""
    return {"type": kind, "event_id": f"event_{uuid.uuid4().hex[:20]}", **fields}


def error_event(exc: RealtimeError, client_event_id: str | None = None) -> dict[str, Any]:
    return event("error", error={"type": exc.err_type, "code": exc.code, "message": str(exc), "param": exc.param,
                                 "event_id": client_event_id})


def parse_client_event(frame: str | bytes | None, known: frozenset[str]) -> dict[str, Any]:
    """A client's JSON text frame as an event whose ``type`` is in ``known``; ``RealtimeError`` otherwise."""
    if not isinstance(frame, str):
        raise RealtimeError("binary frames are not events: send JSON text", "invalid_json")
    try:
        body = json.loads(frame)
    except json.JSONDecodeError as exc:
        raise RealtimeError(f"the event is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise RealtimeError("an event must be a JSON object with a 'type'", "invalid_json")
    if body.get("type") not in known:
        raise RealtimeError(f"Invalid value: {body.get('type')!r}. Supported values are: "
                            f"{', '.join(sorted(known))}.", "invalid_value", "type")
    return body


def client_event_id(frame: str | bytes | None) -> str | None:
    """The ``event_id`` of a client frame, if it has one (for the error that answers it)."""
    try:
        body = json.loads(frame) if isinstance(frame, str) else None
    except json.JSONDecodeError:
        return None
    return body.get("event_id") if isinstance(body, dict) else None


class EventSession:
    """What the WebSocket sessions share: each client event type of ``EVENTS`` is handled by the method
    ``_on_<name>`` (``session.update`` -> ``_on_session_update``), refusals become ``error`` events."""

    EVENTS: type[enum.Enum]

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        self.id = f"sess_{uuid.uuid4().hex[:20]}"
        self.send = send
        self._handlers = {kind.value: getattr(self, "_on_" + kind.name.lower()) for kind in self.EVENTS}
        self._known = frozenset(self._handlers)

    def created(self) -> dict[str, Any]:
        return event("session.created", session=self.config.to_json(self.id))  # type: ignore[attr-defined]

    async def handle(self, frame: str | bytes | None) -> None:
        """One client event (a JSON text frame); a refusal changes nothing and goes back as an ``error``."""
        try:
            body = parse_client_event(frame, self._known)
            await self._handlers[body["type"]](body)
        except RealtimeError as exc:
            self.send(error_event(exc, client_event_id(frame)))
        except SessionConfigError as exc:
            self.send(error_event(RealtimeError(str(exc), "invalid_value", exc.param), client_event_id(frame)))
