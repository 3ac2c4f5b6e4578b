"""``TransferQueueService``: the buffer, its log, blocked readers and group timeouts.

Both APIs (HTTP and RPC) call this and nothing below it. Everything runs on one
event loop, so the buffer needs no lock; only the log's fsync leaves the loop.

Ordering that makes delivery exactly-once across crashes: a write is
acknowledged after its WRITE record is on disk; a read takes its groups, logs
CONSUME and answers only once that record is on disk. The log is sequential, so
a durable CONSUME implies durable writes before it; a crash before it leaves
the groups unread after recovery, to be delivered then, and never twice.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

from omni_engine.transfer_queue import records
from omni_engine.transfer_queue.buffer import BufferFull, Group, TrajectoryBuffer
from omni_engine.transfer_queue.data_model import BufferConfig, BufferStatus, StoredTrajectory
from omni_engine.transfer_queue.spill import SpillFile
from omni_engine.transfer_queue.wal import LogFailed, RecordType, WriteAheadLog

logger = logging.getLogger(__name__)

# Groups handed to an RPC reader go back to the queue if it does not acknowledge them in this time.
ACK_TIMEOUT_S = 60.0
# A log segment is compacted once it is this big and twice what a snapshot would hold.
COMPACT_MIN_BYTES = 64 << 20


class Durability(str, enum.Enum):
    FSYNC = "fsync"  # acknowledged once on disk: survives the machine
    WRITE = "write"  # acknowledged once written to the file: survives the process (kill -9)
    OFF = "off"  # memory only, as slime's buffer


class WriteResult(msgspec.Struct, kw_only=True):
    written: int = 0
    duplicates: int = 0
    refused: int = 0  # not taken (the buffer is full); retry them
    error: str | None = None
    retry_after_s: float | None = None


class DeliveryExpired(Exception):
    """An ``ack`` for groups that are no longer handed out (acknowledged too late)."""


class Delivery:
    """Groups handed to a reader and not yet acknowledged."""

    def __init__(self, delivery_id: int, groups: list[Group]) -> None:
        self.delivery_id = delivery_id
        self.groups = groups
        self.timer: asyncio.TimerHandle | None = None
        self.deleted: set[str] = set()  # instances deleted meanwhile: not put back
        self.reset = False  # the buffer was reset meanwhile: nothing is put back


class ServiceUnavailable(Exception):
    """The log failed: nothing can be acknowledged until a restart recovers from it."""


class TransferQueueService:
    def __init__(self, config: BufferConfig | dict[str, Any] | None = None,
                 data_dir: str | os.PathLike | None = None, durability: Durability = Durability.FSYNC,
                 compact_min_bytes: int = COMPACT_MIN_BYTES, ack_timeout_s: float = ACK_TIMEOUT_S) -> None:
        """``config``: applied after recovery from ``data_dir``; a dict changes only the fields it
        names (what a restart with a few flags means), a ``BufferConfig`` replaces them all."""
        self.config_override = config
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.durability = Durability(durability) if data_dir is not None else Durability.OFF
        self.compact_min_bytes = compact_min_bytes
        self.ack_timeout_s = ack_timeout_s
        self._deliveries: dict[int, Delivery] = {}
        self._delivery_ids = itertools.count(1)
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        self.spill = SpillFile(self.data_dir)
        self.buffer = TrajectoryBuffer(BufferConfig(), self.spill)
        self.wal: WriteAheadLog | None = None
        self.recovered_records = 0
        self.recovery_seconds = 0.0
        self._waiters: deque[asyncio.Future] = deque()
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Recover from the data directory (if any), then apply the configuration given."""
        self._loop = asyncio.get_running_loop()
        if self.durability is not Durability.OFF:
            t0 = time.perf_counter()
            self.wal = WriteAheadLog(self.data_dir, sync=self.durability is Durability.FSYNC)
            for rtype, body in self.wal.recover():
                records.apply(self.buffer, rtype, body)
                self.recovered_records += 1
            if self.wal.generation == 0:
                self.wal.start(records.snapshot_record(self.buffer))
            self.recovery_seconds = time.perf_counter() - t0
            if self.recovered_records:
                status = self.buffer.status()
                logger.info("transfer queue: recovered %d log records in %.2f s: %d ready and %d incomplete "
                            "groups, %d trajectories consumed so far", self.recovered_records,
                            self.recovery_seconds, status.pending_groups, status.incomplete_groups,
                            status.total_consumed)
        wanted = self.config_override
        if isinstance(wanted, dict):
            wanted = msgspec.convert({**msgspec.structs.asdict(self.buffer.config), **wanted}, BufferConfig)
        if wanted is not None and wanted != self.buffer.config:
            await self.configure(wanted)
        self._schedule_expiry()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._expiry is not None:
            self._expiry.cancel()
        for delivery in self._deliveries.values():
            delivery.timer.cancel()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(ServiceUnavailable("transfer queue is shutting down"))
        if self.wal is not None:
            await self.wal.close()
        self.spill.close()

    # --------------------------------------------------------------- writes
    async def write(self, items: list[StoredTrajectory]) -> WriteResult:
        """Take ``items`` in order; returns once the taken ones are durable. Stops at the first
        that does not fit (the rest are refused: retrying them keeps their order)."""
        result, durable = self.write_nowait(items)
        if durable is not None:
            try:
                await asyncio.shield(durable)
            except LogFailed as exc:
                raise ServiceUnavailable(str(exc)) from exc
        return result

    def write_nowait(self, items: list[StoredTrajectory]) -> tuple[WriteResult, asyncio.Future | None]:
        """``write`` without the wait: the result, and a future that resolves once it is durable
        (None: nothing to wait for). For callers that answer from a callback, not a task."""
        self._check_usable()
        result = WriteResult()
        accepted: list[StoredTrajectory] = []
        completed = False
        now = time.time()
        for i, item in enumerate(items):
            try:
                outcome = self.buffer.write(item, now)
            except BufferFull as exc:
                result.refused = len(items) - i
                result.error, result.retry_after_s = str(exc), exc.retry_after_s
                break
            if outcome is False:
                result.duplicates += 1
                continue
            accepted.append(item)
            completed = completed or outcome is not None
        result.written = len(accepted)
        durable = None
        if accepted:
            if self.buffer.config.group_timeout_seconds is not None and self._expiry is None:
                self._schedule_expiry()
            if self.wal is not None:  # (no log: no record to build)
                durable = self._append(records.write_record(now, accepted))
        if completed:
            # Now, not once durable: a reader's CONSUME is logged after this WRITE either way.
            self._wake_next()
        return result, durable

    # ---------------------------------------------------------------- reads
    async def take(self, max_groups: int | None = None, timeout: float | None = None) -> Delivery | None:
        """Hand up to ``max_groups`` ready groups (None: all) to a reader, who must ``ack`` them:
        only then are they consumed (logged). With ``timeout`` (seconds, or ``float('inf')``) and
        none ready, wait for the write that completes one. None: nothing ready in time."""
        self._check_usable()
        groups = self.buffer.take_ready(max_groups)
        if not groups and timeout is not None and timeout > 0:
            groups = await self._wait_and_take(max_groups, timeout)
        if self.buffer.ready:
            self._wake_next()
        if not groups:
            return None
        delivery = Delivery(next(self._delivery_ids), groups)
        delivery.timer = self._loop.call_later(self.ack_timeout_s, self.release, delivery.delivery_id)
        self._deliveries[delivery.delivery_id] = delivery
        return delivery

    async def ack(self, delivery_id: int) -> list[Group]:
        """The reader has the groups: consume them; returns once that is on disk."""
        delivery = self._deliveries.pop(delivery_id, None)
        if delivery is None:
            raise DeliveryExpired(f"delivery {delivery_id} is unknown or was not acknowledged within "
                                  f"{self.ack_timeout_s} s (its groups went back to the queue)")
        delivery.timer.cancel()
        groups = delivery.groups
        try:
            await self._log(records.encode(RecordType.CONSUME, records.ConsumeRecord([g.group_id for g in groups])))
        except BaseException:
            # Not acknowledged after all (cancelled, or the log failed): back to the front, and a
            # RESTORE after the CONSUME, which may still reach the log.
            self._restore(delivery)
            if self.wal is not None:
                self._log_in_background(self._restore_record(groups))
            raise
        return groups

    def release(self, delivery_id: int) -> None:
        """A delivery its reader will not acknowledge (gone, or too late): its groups go back to the
        front of the queue. Nothing to log: they were never consumed."""
        delivery = self._deliveries.pop(delivery_id, None)
        if delivery is not None:
            delivery.timer.cancel()
            self._restore(delivery)

    def _restore(self, delivery: Delivery) -> None:
        groups = [g for g in delivery.groups if g.instance_id not in delivery.deleted and not delivery.reset]
        if groups:
            self.buffer.restore(groups)
            self._wake_next()

    def undelivered(self) -> list[Group]:
        """Groups handed out and not yet acknowledged: still ready as far as the log knows."""
        return [g for d in self._deliveries.values() if not d.reset for g in d.groups if g.instance_id not in d.deleted]

    async def read(self, max_groups: int | None = None, timeout: float | None = None) -> list[Group]:
        """``take`` and ``ack`` at once: for a reader that cannot acknowledge (HTTP), consumed
        once logged, whether or not the response then reaches it."""
        delivery = await self.take(max_groups, timeout)
        return [] if delivery is None else await self.ack(delivery.delivery_id)

    async def _wait_and_take(self, max_groups: int | None, timeout: float) -> list[Group]:
        """Wait in line (first come, first served) until groups are ready or ``timeout`` passes."""
        deadline = self._loop.time() + timeout
        front = False
        while True:
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return []
            waiter = self._loop.create_future()
            # Woken but beaten to the groups by a reader that did not wait: keep its place.
            (self._waiters.appendleft if front else self._waiters.append)(waiter)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), None if remaining == float("inf") else remaining)
            except asyncio.TimeoutError:
                self._leave(waiter)
                return []
            except asyncio.CancelledError:
                self._leave(waiter)
                raise
            groups = self.buffer.take_ready(max_groups)
            if groups:
                return groups
            front = True

    def _leave(self, waiter: asyncio.Future) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
            self._wake_next()  # woken, but leaving: pass the wake on
        elif not waiter.done():
            waiter.cancel()

    def _wake_next(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _restore_record(self, groups: list[Group]) -> bytes:
        return records.encode(RecordType.RESTORE, records.RestoreRecord(
            [records.group_state(self.buffer, g) for g in groups]))

    @property
    def blocked_readers(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    # ---------------------------------------------------------------- admin
    async def configure(self, config: BufferConfig) -> BufferConfig:
        problems = config.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self._check_usable()
        self.buffer.configure(config)
        self._schedule_expiry()
        await self._log(records.encode(RecordType.CONFIG, config))
        return config

    async def delete_instance(self, instance_id: str) -> tuple[int, int]:
        self._check_usable()
        removed = self.buffer.delete_instance(instance_id)
        for delivery in self._deliveries.values():
            delivery.deleted.add(instance_id)
        self._schedule_expiry()
        await self._log(records.encode(RecordType.DELETE, records.DeleteRecord(instance_id)))
        return removed

    async def reset(self) -> None:
        self._check_usable()
        self.buffer.reset()
        for delivery in self._deliveries.values():
            delivery.reset = True
        self._schedule_expiry()
        await self._log(records.encode(RecordType.RESET))

    def status(self) -> BufferStatus:
        return self.buffer.status(self.wal.disk_bytes() if self.wal is not None else 0)

    @property
    def healthy(self) -> bool:
        return not self._closed and (self.wal is None or self.wal.failed is None)

    # -------------------------------------------------------------- timeouts
    def _schedule_expiry(self) -> None:
        deadline = self.buffer.next_deadline()
        if deadline == self._expiry_at:
            return
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._expiry_at = deadline
        if deadline is not None and self._loop is not None:
            self._expiry = self._loop.call_at(self._loop.time() + max(0.0, deadline - time.time()), self._expire)

    def _expire(self) -> None:
        self._expiry = self._expiry_at = None
        due = self.buffer.due(time.time())
        if due and self.healthy:
            policy = self.buffer.config.group_timeout_policy
            ready = self.buffer.expire(due, policy)
            logger.info("transfer queue: %d groups timed out (%s)", len(due), policy.value)
            self._log_in_background(records.encode(RecordType.EXPIRE, records.ExpireRecord(due, policy)))
            if ready:
                self._wake_next()
        self._schedule_expiry()

    # ------------------------------------------------------------------ log
    def _check_usable(self) -> None:
        if self._closed:
            raise ServiceUnavailable("transfer queue is shut down")
        if self.wal is not None and self.wal.failed is not None:
            raise ServiceUnavailable(f"transfer queue log failed ({self.wal.failed}); restart it to recover "
                                     "from its data directory")

    async def _log(self, record: bytes) -> None:
        future = self._append(record)
        if future is not None:
            try:
                await asyncio.shield(future)
            except LogFailed as exc:
                raise ServiceUnavailable(str(exc)) from exc

    def _append(self, record: bytes) -> asyncio.Future | None:
        if self.wal is None:
            return None
        try:
            future = self.wal.append(record)
        except LogFailed as exc:
            raise ServiceUnavailable(str(exc)) from exc
        self._maybe_compact()
        return future

    def _log_in_background(self, record: bytes) -> None:
        if self.wal is None:
            return
        try:
            future = self.wal.append(record)
        except LogFailed:
            return
        if future is not None:
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        wal = self.wal
        if wal.segment_bytes < self.compact_min_bytes:
            return
        live = self.buffer.memory_bytes + self.spill.live_bytes + 48 * len(self.buffer.seen_uids)
        if wal.segment_bytes >= 2 * live:
            t0 = time.perf_counter()
            snapshot = records.snapshot_record(self.buffer, self.undelivered())
            wal.rotate(snapshot).add_done_callback(lambda f: f.cancelled() or f.exception())
            logger.info("transfer queue: log compacted to a %d-byte snapshot (encoded in %.1f ms)",
                        len(snapshot), (time.perf_counter() - t0) * 1e3)
