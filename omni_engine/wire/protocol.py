"""Message types and structs of the client ⇄ stage-process protocol.

Frames: request ``[identity, type, body, *aux]`` on the client's ROUTER (the
stage's DEALER sees ``[type, body, *aux]``); response ``[type, body, *aux]``
on the stage's PUSH. ``type`` is one byte, so a peer can dispatch before
decoding the body.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class StageRequestType(bytes, enum.Enum):
    GENERATE = b"\x00"
    ABORT = b"\x01"
    HEALTH_CHECK = b"\x02"
    UTILITY = b"\x03"
    SHUTDOWN = b"\x04"
    # Shared-memory slots whose views the client no longer holds.
    RELEASE = b"\x05"


class StageResponseType(bytes, enum.Enum):
    READY = b"\x10"
    OUTPUT = b"\x11"
    ERROR = b"\x12"
    HEALTH = b"\x13"
    UTILITY_RESULT = b"\x14"
    DEAD = b"\x15"
    # "Still here", sent by a stage told to (one on another host) whenever it has been
    # quiet for its heartbeat interval: its client takes silence as the loss of its node.
    HEARTBEAT = b"\x16"


class StageGenerateRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt: Any
    sampling_params: Any = None
    arrival_time: float = 0.0


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


class StageOutputs(msgspec.Struct, array_like=True, gc=False):
    """Every output ready at once, in one message (as vLLM's EngineCoreOutputs)."""

    outputs: list[Any]
    timestamp: float = 0.0


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
