"""What the write-ahead log records, and how a record is applied to a buffer.

The service applies an operation to its ``TrajectoryBuffer`` and logs it; the
log's replay applies the same records through ``apply`` to a fresh buffer. One
function per record type, shared by nothing else, keeps the two in step.
"""

from __future__ import annotations

import msgspec

from omni_engine.transfer_queue.buffer import Group, TrajectoryBuffer
from omni_engine.transfer_queue.data_model import (
    BufferConfig,
    PayloadFormat,
    StoredTrajectory,
    TimeoutPolicy,
    parse_trajectory,
)
from omni_engine.transfer_queue.wal import RecordType, frame


class WriteRecord(msgspec.Struct, array_like=True):
    now: float
    items: list[tuple[int, bytes]]  # (PayloadFormat, payload)


class ConsumeRecord(msgspec.Struct, array_like=True):
    group_ids: list[int]


class ExpireRecord(msgspec.Struct, array_like=True):
    group_ids: list[int]
    policy: TimeoutPolicy


class DeleteRecord(msgspec.Struct, array_like=True):
    instance_id: str


class GroupState(msgspec.Struct, array_like=True):
    group_id: int
    instance_id: str
    size: int
    opened_at: float
    ready: bool
    complete: bool
    items: list[tuple[int, bytes]]


class RestoreRecord(msgspec.Struct, array_like=True):
    groups: list[GroupState]


class Snapshot(msgspec.Struct, array_like=True):
    config: BufferConfig
    next_group_id: int
    counters: list[int]  # total_trajectories, total_consumed, duplicates, delivered, dropped, refused
    seen_uids: list[str]
    groups: list[GroupState]  # ready ones in delivery order, then incomplete ones oldest first


_encoder = msgspec.msgpack.Encoder()
_DECODERS = {
    RecordType.WRITE: msgspec.msgpack.Decoder(WriteRecord),
    RecordType.CONSUME: msgspec.msgpack.Decoder(ConsumeRecord),
    RecordType.EXPIRE: msgspec.msgpack.Decoder(ExpireRecord),
    RecordType.DELETE: msgspec.msgpack.Decoder(DeleteRecord),
    RecordType.CONFIG: msgspec.msgpack.Decoder(BufferConfig),
    RecordType.RESTORE: msgspec.msgpack.Decoder(RestoreRecord),
    RecordType.SNAPSHOT: msgspec.msgpack.Decoder(Snapshot),
}


def encode(rtype: RecordType, body: msgspec.Struct | None = None) -> bytes:
    """The framed record."""
    return frame(rtype, _encoder.encode(body) if body is not None else b"")


def write_record(now: float, items: list[StoredTrajectory]) -> bytes:
    return encode(RecordType.WRITE, WriteRecord(now, [(t.fmt, t.payload) for t in items]))


def group_state(buffer: TrajectoryBuffer, group: Group) -> GroupState:
    """A group with its payloads (read back from the spill file where spilled)."""
    items = [(t.fmt, t.payload if t.payload is not None else buffer.spill.read(t.spill_offset, t.size))
             for t in group.items]
    return GroupState(group.group_id, group.instance_id, group.size, group.opened_at, group.ready,
                      group.complete, items)


def snapshot_record(buffer: TrajectoryBuffer, undelivered: list[Group] = ()) -> bytes:
    """The buffer as the log knows it: ``undelivered`` (handed to readers, not acknowledged)
    are still ready, at the front."""
    b = buffer
    consumed = b.total_consumed - sum(len(g.items) for g in undelivered)
    counters = [b.total_trajectories, consumed, b.duplicates_dropped, b.timed_out_delivered,
                b.timed_out_dropped, b.writes_refused]
    groups = [group_state(b, g) for g in undelivered] + [group_state(b, g) for g in b.groups()]
    for state in groups[:len(undelivered)]:
        state.ready = True
    return encode(RecordType.SNAPSHOT, Snapshot(b.config, b.next_group_id, counters, list(b.seen_uids), groups))


def _group(state: GroupState) -> Group:
    items = [parse_trajectory(payload, PayloadFormat(fmt)) for fmt, payload in state.items]
    return Group(state.group_id, state.instance_id, state.size, state.opened_at, items, state.ready, state.complete)


def _load_snapshot(buffer: TrajectoryBuffer, snap: Snapshot) -> None:
    buffer.reset()
    buffer.configure(snap.config)
    buffer.next_group_id = snap.next_group_id
    (buffer.total_trajectories, buffer.total_consumed, buffer.duplicates_dropped, buffer.timed_out_delivered,
     buffer.timed_out_dropped, buffer.writes_refused) = snap.counters
    buffer.seen_uids = set(snap.seen_uids)
    for state in snap.groups:
        group = _group(state)
        for item in group.items:
            # Limits were met when these were written; incomplete groups spill as they did then.
            buffer.place(item, spill_ok=not group.ready, enforce_limits=False)
        if group.ready:
            buffer.ready[group.group_id] = group
        else:
            buffer.open[group.instance_id] = group


def apply(buffer: TrajectoryBuffer, rtype: RecordType, body: memoryview) -> None:
    """Replay one record."""
    msg = _DECODERS[rtype].decode(body) if rtype is not RecordType.RESET else None
    if rtype is RecordType.WRITE:
        for fmt, payload in msg.items:
            buffer.write(parse_trajectory(payload, PayloadFormat(fmt)), msg.now, enforce_limits=False)
    elif rtype is RecordType.CONSUME:
        buffer.consume(msg.group_ids)
    elif rtype is RecordType.EXPIRE:
        buffer.expire(msg.group_ids, msg.policy)
    elif rtype is RecordType.DELETE:
        buffer.delete_instance(msg.instance_id)
    elif rtype is RecordType.RESET:
        buffer.reset()
    elif rtype is RecordType.CONFIG:
        buffer.configure(msg)
    elif rtype is RecordType.RESTORE:
        buffer.restore([_group(state) for state in msg.groups])
    elif rtype is RecordType.SNAPSHOT:
        _load_snapshot(buffer, msg)
