"""Message types and structs of the client ⇄ stage-process protocol, and its frames.

Frames: request ``[identity, type, body, *aux]`` on the client's ROUTER (the
stage's DEALER sees ``[type, body, *aux]``); response ``[type, body, *aux]``
on the stage's PUSH. The GENERATEs a client sends in one turn of its loop go
as one ``[GENERATE_BATCH, counts, *(body, *aux) of each]`` message (``counts``:
the frames of each request), as a stage's outputs of one turn go as one
``StageOutputs``: a message costs both ends (and ZMQ's I/O threads) far more
than a request's decoding does. ``type`` is one byte, so a peer can dispatch before
decoding the body; anything wrong with the frames is a ``WireFormatError``
naming the frame at fault.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from omni_engine.tracing.stage_timing import StageTiming
from omni_engine.wire.headers import WireFormatError

if TYPE_CHECKING:
    from omni_engine.wire.stage_serialization import StageMsgpackDecoder


class StageRequestType(bytes, enum.Enum):
    GENERATE = b"\x00"
    ABORT = b"\x01"
    HEALTH_CHECK = b"\x02"
    UTILITY = b"\x03"
    SHUTDOWN = b"\x04"
    # Shared-memory slots whose views the client no longer holds.
    RELEASE = b"\x05"
    # Several GENERATEs in one message (see the module docstring); decoded by split_generate_batch.
    GENERATE_BATCH = b"\x06"


class StageResponseType(bytes, enum.Enum):
    READY = b"\x10"
    OUTPUT = b"\x11"
    ERROR = b"\x12"
    HEALTH = b"\x13"
    UTILITY_RESULT = b"\x14"
    DEAD = b"\x15"
    # "Still here", sent by a stage told to (one on another host) every heartbeat
    # interval: its client takes silence as the loss of its node.
    HEARTBEAT = b"\x16"


class InputStream(enum.IntEnum):
    """A GENERATE's place in a request whose input comes in parts (a talker fed the thinker's
    states as the thinker writes them): ``OPEN`` starts it, each ``MORE`` appends to the running
    request of that id, ``END`` appends its last part. A part for a request that has ended (the
    talker spoke its stop code first) is dropped by the stage."""

    NONE = 0
    OPEN = 1
    MORE = 2
    END = 3


class StageGenerateRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt: Any
    sampling_params: Any = None
    arrival_time: float = 0.0
    # Set for a traced request: the W3C trace headers of the request's span in this stage (an
    # llm stage hands them to vLLM, whose own request span then joins the trace). The stage
    # answers with a StageTiming beside the final output (StageOutputs.timings).
    trace: dict[str, str] | None = None
    # When the request's output is needed (wall-clock seconds, ``time.time()``): a piece of speech
    # is due when its listener's buffer runs dry. Stages serve earliest deadline first; None is
    # "no hurry" (``deadlines.NO_DEADLINE_SLACK_S`` after arrival).
    deadline: float | None = None
    input_stream: InputStream = InputStream.NONE
    # Partial outputs carry the states written since the last one (an llm stage with
    # engine_output_type latent whose consumer starts on its first states).
    stream_states: bool = False
    # vLLM's LoRARequest for an llm stage started with ``enable_lora``: the adapter this request runs with.
    lora_request: Any = None


class StageAbortRequest(msgspec.Struct, array_like=True, gc=False):
    request_ids: list[str]
    # True: each aborted request still ends with a final output (finish_reason "abort",
    # its partial text), as vLLM's AsyncLLM ends an aborted stream; the client keeps the
    # id until then. False: the requests just stop; the client has forgotten them.
    final_outputs: bool = False


class StageHealthCheck(msgspec.Struct, array_like=True, gc=False):
    call_id: int


class StageUtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class StageReleaseRequest(msgspec.Struct, array_like=True, gc=False):
    segments: list[str]


class StageShutdown(msgspec.Struct, array_like=True, gc=False):
    reason: str = ""


class StageReady(msgspec.Struct, array_like=True, gc=False):
    stage_id: int
    pid: int
    # Segments this stage creates start with this; the client unlinks them by
    # it if the stage dies.
    shm_prefix: str
    engine_info: dict[str, Any]
    # The shared-memory domain the stage runs in (utils.host_id: a machine, or a Ray
    # node): a client on another host gets no shared-memory handle from it, and takes none.
    host_id: str = ""


class StageOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Every output ready at once, in one message (as vLLM's EngineCoreOutputs)."""

    outputs: list[Any]
    timestamp: float = 0.0
    # Request id -> what the stage recorded, for traced requests whose final output is in
    # ``outputs`` (encoded after them: the shared-memory bytes they took are counted in).
    timings: dict[str, StageTiming] | None = None


# StageError.error_type of a GENERATE refused because its id is in flight.
DUPLICATE_REQUEST = "DuplicateRequest"
# StageError.error_type of a message that did not decode.
MALFORMED_MESSAGE = "MalformedMessage"


class StageError(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A failure of one request (request_id set) or of one message (None)."""

    message: str
    request_id: str | None = None
    error_type: str = "Error"


class StageHealth(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    healthy: bool
    num_running: int
    pid: int


class StageUtilityResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    result: Any = None
    error: str | None = None


class StageDead(msgspec.Struct, array_like=True, gc=False):
    message: str


class StageHeartbeat(msgspec.Struct, array_like=True, gc=False):
    timestamp: float = 0.0


REQUEST_STRUCTS: dict[StageRequestType, type[msgspec.Struct]] = {
    StageRequestType.GENERATE: StageGenerateRequest,
    StageRequestType.ABORT: StageAbortRequest,
    StageRequestType.HEALTH_CHECK: StageHealthCheck,
    StageRequestType.UTILITY: StageUtilityRequest,
    StageRequestType.SHUTDOWN: StageShutdown,
    StageRequestType.RELEASE: StageReleaseRequest,
}

RESPONSE_STRUCTS: dict[StageResponseType, type[msgspec.Struct]] = {
    StageResponseType.READY: StageReady,
    StageResponseType.OUTPUT: StageOutputs,
    StageResponseType.ERROR: StageError,
    StageResponseType.HEALTH: StageHealth,
    StageResponseType.UTILITY_RESULT: StageUtilityResult,
    StageResponseType.DEAD: StageDead,
    StageResponseType.HEARTBEAT: StageHeartbeat,
}


# ----------------------------------------------------------------------------- frames
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
    decoder = decoders.get(kind)
    if decoder is None:  # (GENERATE_BATCH: its parts are decoded one by one, split_generate_batch)
        raise WireFormatError(f"frame 0: {kind.name} is not decoded as one message")
    try:
        return kind, decoder.decode(frames[1:])
    except WireFormatError as exc:
        raise type(exc)(f"{kind.name} body (frame 1): {exc}") from None


_BATCH_COUNTS = msgspec.msgpack.Decoder(list[int])


def split_generate_batch(frames: list[Any]) -> list[list[Any]]:
    """The ``[body, *aux]`` frames of each GENERATE in a GENERATE_BATCH message."""
    if len(frames) < 3:
        raise WireFormatError(f"GENERATE_BATCH: expected [type, counts, *requests] frames, got {len(frames)}")
    try:
        counts = _BATCH_COUNTS.decode(frames[1].buffer)
    except msgspec.DecodeError as exc:
        raise WireFormatError(f"GENERATE_BATCH counts (frame 1): {exc}") from None
    if not counts or min(counts) < 1 or sum(counts) != len(frames) - 2:
        raise WireFormatError(f"GENERATE_BATCH counts (frame 1): {counts!r:.80} do not split the "
                              f"{len(frames) - 2} request frame(s) into requests of one frame or more")
    parts, start = [], 2
    for count in counts:
        parts.append(frames[start:start + count])
        start += count
    return parts


def guess_request_id(frames: list[Any]) -> str | None:
    """The request id of a GENERATE whose body failed to decode, if its first field is a string.

    Only GENERATE: the first string of another message type (a SHUTDOWN
    reason, ...) is no request id, and an ERROR naming it would fail a request
    the message never was about.
    """
    if len(frames) < 2 or frames[0].bytes != StageRequestType.GENERATE.value:
        return None
    return guess_generate_id(frames[1])


def guess_generate_id(body: Any) -> str | None:
    """``guess_request_id`` of a GENERATE's body frame."""
    try:
        fields = msgspec.msgpack.decode(body.bytes, type=list[msgspec.Raw])
        return msgspec.msgpack.decode(fields[0], type=str) if fields else None
    except (msgspec.DecodeError, RecursionError):
        return None


def message_kind(frames: list[bytes], types: dict[bytes, enum.Enum]) -> str:
    """A short description of an unexpected message, for a log line."""
    kind = types.get(frames[1]) if len(frames) > 1 else None
    return kind.name if kind is not None else f"{len(frames)}-frame message"
