"""The RPC wire format: ZMQ DEALER (client) <-> ROUTER (server), msgpack headers.

Request ``[type, header]`` or ``[type, header, batch]``, response the same:
a batch of trajectories is one frame, a msgpack array whose elements are the
trajectories' own msgpack maps. One frame, not one per trajectory: pyzmq costs
about 2 us per frame on each side, as much as everything else the server does
for a trajectory. The server keeps each element's bytes as they came (a slice
of the array, found by decoding it as ``list[Raw]``) and sends them back the
same way, joined behind an array header. Every call carries a ``call_id`` its
reply repeats, so one socket carries many calls at once; a subscription's
pushes carry the id of its SUBSCRIBE.

Reads are two-phase: GROUPS carry a ``delivery_id`` the reader ACKs once it has
them, and only that consumes them (logged before the ACK is answered). A reader
that dies before acknowledging loses nothing: its groups go back to the queue
(at once when a reply to it fails, else after the ack timeout), and a server
that dies before logging the ACK delivers them again after recovery; what an
answered ACK consumed never comes back.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class RpcType(bytes, enum.Enum):
    BATCH_WRITE = b"\x01"  # CallHeader; batch frame: the trajectories
    BATCH_READ = b"\x02"  # BatchReadRequest
    GET_STATUS = b"\x03"  # CallHeader
    SUBSCRIBE = b"\x04"  # SubscribeRequest; pushes GROUPS while it has credit
    CREDIT = b"\x05"  # CreditGrant: the subscriber may receive n more groups
    UNSUBSCRIBE = b"\x06"  # CallHeader (the SUBSCRIBE's id)
    ACK = b"\x07"  # AckRequest: the reader has a delivery's groups; consume them (answered once logged)
    RESULT = b"\x81"  # RpcResult
    GROUPS = b"\x82"  # GroupsHeader; batch frame: the groups' trajectories in order


RPC_TYPES = {t.value: t for t in RpcType}  # (a dict lookup: cheaper than RpcType(b))


class RpcErrorType(str, enum.Enum):
    BUFFER_FULL = "BufferFull"  # retry after retry_after_s
    INVALID_TRAJECTORY = "InvalidTrajectory"
    BAD_REQUEST = "BadRequest"
    UNAVAILABLE = "ServiceUnavailable"  # the log failed, or the server is stopping
    DELIVERY_EXPIRED = "DeliveryExpired"  # acknowledged too late: the groups went back to the queue


class CallHeader(msgspec.Struct, array_like=True):
    call_id: int


class BatchReadRequest(msgspec.Struct, array_like=True):
    call_id: int
    max_groups: int | None = None
    block: bool = False
    timeout_ms: int | None = None  # with block: None waits until a group is ready


class SubscribeRequest(msgspec.Struct, array_like=True):
    call_id: int
    prefetch_groups: int = 1


class AckRequest(msgspec.Struct, array_like=True):
    call_id: int
    delivery_id: int


class CreditGrant(msgspec.Struct, array_like=True):
    call_id: int
    groups: int


class RpcResult(msgspec.Struct, array_like=True):
    call_id: int
    ok: bool
    value: Any = None  # WriteResult / BufferStatus as a map
    error: str | None = None
    error_type: RpcErrorType | None = None
    retry_after_s: float | None = None


class GroupHeader(msgspec.Struct, array_like=True):
    instance_id: str
    group_size: int
    is_complete: bool
    num_trajectories: int


class GroupsHeader(msgspec.Struct, array_like=True):
    call_id: int
    delivery_id: int  # to ACK; unacknowledged, the groups go back to the queue after the ack timeout
    groups: list[GroupHeader]


REQUEST_HEADERS: dict[RpcType, type[msgspec.Struct]] = {
    RpcType.BATCH_WRITE: CallHeader,
    RpcType.BATCH_READ: BatchReadRequest,
    RpcType.GET_STATUS: CallHeader,
    RpcType.SUBSCRIBE: SubscribeRequest,
    RpcType.CREDIT: CreditGrant,
    RpcType.UNSUBSCRIBE: CallHeader,
    RpcType.ACK: AckRequest,
}
REQUEST_DECODERS = {t: msgspec.msgpack.Decoder(cls) for t, cls in REQUEST_HEADERS.items()}
RESULT_DECODER = msgspec.msgpack.Decoder(RpcResult)
GROUPS_DECODER = msgspec.msgpack.Decoder(GroupsHeader)
encode = msgspec.msgpack.Encoder().encode


def pack_batch(payloads: list[bytes]) -> bytes:
    """A batch frame from trajectories already encoded: an array of them, their bytes as they are."""
    return encode([msgspec.Raw(p) for p in payloads])
