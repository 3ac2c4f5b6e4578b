"""``[type, body, *data]`` frames to messages, for both ends of a stage connection.

The type byte comes first so a receiver dispatches before decoding; anything
wrong with the frames is a ``WireFormatError`` naming the frame at fault.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

import msgspec

from omni_engine.wire.protocol import StageRequestType, StageResponseType
from omni_engine.wire.stage_serialization import StageMsgpackDecoder
from omni_engine.wire.headers import WireFormatError

T = TypeVar("T", StageRequestType, StageResponseType)

REQUEST_TYPES = {t.value: t for t in StageRequestType}
RESPONSE_TYPES = {t.value: t for t in StageResponseType}


def decode_frames(frames: list[Any], types: dict[bytes, T], decoders: dict[T, StageMsgpackDecoder]) -> tuple[T, Any]:
    """(type, struct) of one message; ``types`` is ``REQUEST_TYPES`` or ``RESPONSE_TYPES``."""
    if len(frames) < 2:
        raise WireFormatError(f"expected [type, body, *data] frames, got {len(frames)} frame(s)")
    kind = types.get(frames[0].bytes)
    if kind is None:
        raise WireFormatError(f"frame 0: unknown message type {frames[0].bytes[:8]!r}")
    try:
        return kind, decoders[kind].decode(frames[1:])
    except WireFormatError as exc:
        raise type(exc)(f"{kind.name} body (frame 1): {exc}") from None


def guess_request_id(frames: list[Any]) -> str | None:
    """The request id of a GENERATE whose body failed to decode, if its first field is a string.

    Only GENERATE: the first string of another message type (a SHUTDOWN
    reason, ...) is no request id, and an ERROR naming it would fail a request
    the message never was about.
    """
    if len(frames) < 2 or frames[0].bytes != StageRequestType.GENERATE.value:
        return None
    try:
        fields = msgspec.msgpack.decode(frames[1].bytes, type=list[msgspec.Raw])
        return msgspec.msgpack.decode(fields[0], type=str) if fields else None
    except (msgspec.DecodeError, RecursionError):
        return None


def message_kind(frames: list[bytes], types: dict[bytes, enum.Enum]) -> str:
    """A short description of an unexpected message, for a log line."""
    kind = types.get(frames[1]) if len(frames) > 1 else None
    return kind.name if kind is not None else f"{len(frames)}-frame message"
