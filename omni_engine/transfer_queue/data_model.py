"""The TransferQueue's data model: the seed's messages as ``msgspec.Struct``s.

A trajectory is stored as the bytes it arrived in (JSON over HTTP, msgpack over
RPC) beside the few fields the queue itself reads (``StoredTrajectory``): it is
parsed once, never deep-copied, returned to a reader of the same protocol
unchanged (fields the queue does not know included, as slime's buffer returns
them), and converted only when it crosses from one protocol to the other.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class Trajectory(msgspec.Struct, kw_only=True):
    """One complete interaction (one sample of one prompt)."""

    uid: str  # globally unique; a second write of a uid is a duplicate
    instance_id: str  # the prompt it samples; its group's key
    messages: list[dict[str, Any]] = []
    reward: float = 0.0
    extra_info: dict[str, Any] = {}


class TrajectoryGroup(msgspec.Struct, kw_only=True):
    """The samples of one prompt, delivered together."""

    instance_id: str
    trajectories: list[Trajectory]
    group_size: int
    is_complete: bool  # False: delivered by the timeout policy with fewer than group_size


class MetaInfo(msgspec.Struct, kw_only=True):
    """About the groups of one read (slime's ``meta_info``)."""

    total_samples: int = 0
    num_groups: int = 0
    avg_group_size: float = 0.0
    avg_reward: float = 0.0
    finished_group_ids: list[str] = []


class BatchReadResult(msgspec.Struct, kw_only=True):
    success: bool
    message: str
    groups: list[TrajectoryGroup] = []
    meta_info: MetaInfo = msgspec.field(default_factory=MetaInfo)


class BufferStatus(msgspec.Struct, kw_only=True):
    total_trajectories: int  # accepted since the last reset (duplicates not counted)
    total_consumed: int  # trajectories delivered to readers
    pending_groups: int  # complete, not yet read
    incomplete_groups: int
    memory_usage_bytes: int
    disk_usage_bytes: int  # spilled trajectories plus the write-ahead log
    duplicates_dropped: int = 0
    groups_timed_out_delivered: int = 0
    groups_timed_out_dropped: int = 0
    writes_refused: int = 0


class TimeoutPolicy(str, enum.Enum):
    """What happens to a group still incomplete ``group_timeout_seconds`` after its first write."""

    DELIVER_PARTIAL = "deliver_partial"  # becomes ready as it is (is_complete false)
    DROP = "drop"  # discarded, counted in groups_timed_out_dropped


class BufferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /config``. A change applies to groups formed after it; groups already ready stay ready."""

    group_size: int = 16
    task_type: str = "math"  # informational (slime's generators key on it)
    max_memory_bytes: int = 8 << 30
    # Above this fraction of max_memory_bytes, trajectories of incomplete groups go to disk.
    spill_to_disk_threshold: float = 0.8
    # Spilled bytes allowed on disk; beyond them (and max_memory_bytes in memory) writes are refused.
    max_disk_bytes: int = 64 << 30
    uid_dedup: bool = True
    group_timeout_seconds: float | None = None  # None: a group waits for its last sample forever
    group_timeout_policy: TimeoutPolicy = TimeoutPolicy.DELIVER_PARTIAL

    def problems(self) -> list[str]:
        """What is wrong, each naming its field (empty: valid)."""
        out = []
        if self.group_size < 1:
            out.append(f"group_size must be >= 1 (got {self.group_size})")
        if self.max_memory_bytes < 1:
            out.append(f"max_memory_bytes must be >= 1 (got {self.max_memory_bytes})")
        if not 0.0 < self.spill_to_disk_threshold <= 1.0:
            out.append(f"spill_to_disk_threshold must be in (0, 1] (got {self.spill_to_disk_threshold})")
        if self.max_disk_bytes < 0:
            out.append(f"max_disk_bytes must be >= 0 (got {self.max_disk_bytes})")
        if self.group_timeout_seconds is not None and self.group_timeout_seconds <= 0:
            out.append(f"group_timeout_seconds must be > 0 or null (got {self.group_timeout_seconds})")
        return out


class PayloadFormat(enum.IntEnum):
    """How a stored trajectory's bytes are encoded (fixed values: they are in the log)."""

    JSON = 1
    MSGPACK = 2


class TrajectoryKeys(msgspec.Struct):
    """What the queue reads of a trajectory; every other field is carried as bytes."""

    uid: str
    instance_id: str
    reward: float = 0.0


class StoredTrajectory(msgspec.Struct, array_like=True, gc=False):
    """A trajectory as the queue holds it: its keys and its bytes (``payload`` None: spilled)."""

    uid: str
    instance_id: str
    reward: float
    fmt: PayloadFormat
    payload: bytes | None
    size: int  # len(payload), also while spilled
    spill_offset: int = -1


_json_keys = msgspec.json.Decoder(TrajectoryKeys)
_msgpack_keys = msgspec.msgpack.Decoder(TrajectoryKeys)
_msgpack_batch_keys = msgspec.msgpack.Decoder(list[TrajectoryKeys])
_msgpack_batch_raws = msgspec.msgpack.Decoder(list[msgspec.Raw])
_json_any = msgspec.json.Decoder()
_msgpack_any = msgspec.msgpack.Decoder()
_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


class InvalidTrajectory(ValueError):
    """A trajectory the queue cannot take; the message names the field."""


def parse_trajectory(payload: bytes, fmt: PayloadFormat) -> StoredTrajectory:
    """Read the keys of ``payload``; the bytes are kept as they are."""
    try:
        keys = (_json_keys if fmt is PayloadFormat.JSON else _msgpack_keys).decode(payload)
    except msgspec.ValidationError as exc:
        raise InvalidTrajectory(f"invalid trajectory: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidTrajectory(f"trajectory is not valid {fmt.name}: {exc}") from None
    if not keys.uid:
        raise InvalidTrajectory("invalid trajectory: `$.uid` is empty")
    if not keys.instance_id:
        raise InvalidTrajectory("invalid trajectory: `$.instance_id` is empty")
    return StoredTrajectory(keys.uid, keys.instance_id, keys.reward, fmt, payload, len(payload))


def parse_msgpack_batch(batch: Any) -> list[StoredTrajectory]:
    """The trajectories of a msgpack array of trajectories (an RPC batch frame), each stored
    as its own bytes (its slice of the array): two decodes of the whole array, keys and
    slices, rather than one per trajectory."""
    try:
        raws = _msgpack_batch_raws.decode(batch)
        keys = _msgpack_batch_keys.decode(batch)
    except msgspec.ValidationError as exc:  # msgspec's path names the element: `$[2]`
        raise InvalidTrajectory(f"invalid trajectory in the batch: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidTrajectory(f"the batch is not a msgpack array of trajectories: {exc}") from None
    msgpack = PayloadFormat.MSGPACK
    items = []
    for i, (k, raw) in enumerate(zip(keys, raws)):
        if not k.uid or not k.instance_id:
            raise InvalidTrajectory(f"invalid trajectory in the batch: `$[{i}].{'uid' if not k.uid else 'instance_id'}`"
                                    " is empty")
        payload = bytes(raw)
        items.append(StoredTrajectory(k.uid, k.instance_id, k.reward, msgpack, payload, len(payload)))
    return items


def payload_as(payload: bytes, have: PayloadFormat, want: PayloadFormat) -> bytes:
    """``payload`` in the ``want`` encoding (the same bytes when it already is)."""
    if have is want:
        return payload
    if want is PayloadFormat.JSON:
        return _json_encoder.encode(_msgpack_any.decode(payload))
    return _msgpack_encoder.encode(_json_any.decode(payload))


def meta_info(groups: list[tuple[str, list[StoredTrajectory]]]) -> MetaInfo:
    """slime's statistics over the groups of one read."""
    total = sum(len(items) for _, items in groups)
    if not total:
        return MetaInfo()
    return MetaInfo(
        total_samples=total,
        num_groups=len(groups),
        avg_group_size=total / len(groups),
        avg_reward=sum(t.reward for _, items in groups for t in items) / total,
        finished_group_ids=[instance_id for instance_id, _ in groups],
    )
