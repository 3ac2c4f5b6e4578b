"""``TrajectoryBuffer``: grouping, dedup, ready-only consuming reads, memory bounds.

A deterministic state machine with no I/O of its own (but the spill file): the
service drives it live, and recovery drives it again from the write-ahead log,
so both reach the same state. Every decision that depends on the clock (a
group's timeout) arrives as an explicit operation (``expire``), which the log
records, rather than being read from the clock here.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable

from omni_engine.transfer_queue.data_model import (
    BufferConfig,
    BufferStatus,
    StoredTrajectory,
    TimeoutPolicy,
)
from omni_engine.transfer_queue.spill import SpillFile


class BufferFull(Exception):
    """A write refused: memory (and the spill budget) are at their limits. Retry later."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclasses.dataclass(eq=False)
class Group:
    """The samples of one instance collected so far; ready at ``size`` (or by timeout)."""

    group_id: int  # unique within a buffer's life (also across restarts: it is in the log)
    instance_id: str
    size: int  # the group_size in force when it opened
    opened_at: float  # wall-clock time of its first write (timeouts count from it)
    items: list[StoredTrajectory] = dataclasses.field(default_factory=list)
    ready: bool = False
    complete: bool = False


class TrajectoryBuffer:
    """What the queue holds. Single-threaded: call it from one event loop."""

    def __init__(self, config: BufferConfig, spill: SpillFile) -> None:
        self.config = config
        self.spill = spill
        self.open: dict[str, Group] = {}  # instance_id -> the group taking its writes
        self.ready: OrderedDict[int, Group] = OrderedDict()  # in the order they became ready
        self.seen_uids: set[str] = set()
        self.next_group_id = 1
        self.memory_bytes = 0
        self.total_trajectories = 0
        self.total_consumed = 0
        self.duplicates_dropped = 0
        self.timed_out_delivered = 0
        self.timed_out_dropped = 0
        self.writes_refused = 0

    # -------------------------------------------------------------- writes
    def write(self, item: StoredTrajectory, now: float, enforce_limits: bool = True) -> Group | None | bool:
        """Add ``item``. Returns False for a duplicate uid (dropped, as the idempotent write it
        is), the group it completed if it completed one, else None. Raises ``BufferFull``
        (nothing changed) when ``enforce_limits`` and there is no room for it."""
        if self.config.uid_dedup and item.uid in self.seen_uids:
            self.duplicates_dropped += 1
            return False
        group = self.open.get(item.instance_id)
        completes = len(group.items) + 1 >= group.size if group is not None else self.config.group_size <= 1
        self.place(item, spill_ok=not completes, enforce_limits=enforce_limits)
        if group is None:
            group = self.open[item.instance_id] = Group(self.next_group_id, item.instance_id,
                                                        self.config.group_size, now)
            self.next_group_id += 1
        group.items.append(item)
        if self.config.uid_dedup:
            self.seen_uids.add(item.uid)
        self.total_trajectories += 1
        if completes:
            self._make_ready(group, complete=True)
            return group
        return None

    def place(self, item: StoredTrajectory, spill_ok: bool, enforce_limits: bool) -> None:
        """Keep ``item`` in memory, or spill it to disk above the threshold; refuse at the limits."""
        cfg = self.config
        if self.memory_bytes + item.size <= cfg.max_memory_bytes * cfg.spill_to_disk_threshold or not spill_ok:
            if enforce_limits and self.memory_bytes + item.size > cfg.max_memory_bytes:
                self.writes_refused += 1
                raise BufferFull(f"buffer memory is full ({self.memory_bytes} of max_memory_bytes "
                                 f"{cfg.max_memory_bytes} held by {len(self.ready)} ready and {len(self.open)} "
                                 f"incomplete groups): read ready groups, or raise max_memory_bytes")
            self.memory_bytes += item.size
            return
        if enforce_limits and self.spill.live_bytes + item.size > cfg.max_disk_bytes:
            self.writes_refused += 1
            raise BufferFull(f"buffer memory is above its spill threshold and the spill file holds "
                             f"{self.spill.live_bytes} of max_disk_bytes {cfg.max_disk_bytes}: "
                             f"incomplete groups must complete (or time out) first")
        item.spill_offset = self.spill.append(item.payload)
        item.payload = None

    def _make_ready(self, group: Group, complete: bool) -> None:
        if self.open.get(group.instance_id) is group:
            del self.open[group.instance_id]
        group.ready, group.complete = True, complete
        self.ready[group.group_id] = group

    # --------------------------------------------------------------- reads
    def take_ready(self, max_groups: int | None = None) -> list[Group]:
        """Consume up to ``max_groups`` ready groups (all: None), oldest first, their
        trajectories back in memory."""
        taken: list[Group] = []
        while self.ready and (max_groups is None or len(taken) < max_groups):
            _, group = self.ready.popitem(last=False)
            taken.append(self._release(group))
            self.total_consumed += len(group.items)
        return taken

    def consume(self, group_ids: Iterable[int]) -> list[Group]:
        """Consume these groups (recovery replaying a read)."""
        taken = []
        for gid in group_ids:
            group = self.ready.pop(gid, None)
            if group is not None:
                taken.append(self._release(group))
                self.total_consumed += len(group.items)
        return taken

    def restore(self, groups: list[Group]) -> None:
        """Put consumed groups back at the front (their reader never got them)."""
        for group in reversed(groups):
            for item in group.items:
                self.memory_bytes += item.size
            self.total_consumed -= len(group.items)
            group.ready = True
            self.ready[group.group_id] = group
            self.ready.move_to_end(group.group_id, last=False)

    def _release(self, group: Group) -> Group:
        """Take a group's bytes out of the buffer's accounting (reading spilled ones back)."""
        for item in group.items:
            if item.payload is None:
                item.payload = self.spill.read(item.spill_offset, item.size)
                self.spill.free(item.size)
                item.spill_offset = -1
            else:
                self.memory_bytes -= item.size
        return group

    # ------------------------------------------------------------ timeouts
    def next_deadline(self) -> float | None:
        """When the oldest incomplete group times out (None: no timeout, or none open)."""
        timeout = self.config.group_timeout_seconds
        if timeout is None or not self.open:
            return None
        # Dicts keep insertion order and a group never re-enters ``open``: the first is the oldest.
        return next(iter(self.open.values())).opened_at + timeout

    def due(self, now: float) -> list[int]:
        """The incomplete groups whose timeout has passed at ``now``."""
        timeout = self.config.group_timeout_seconds
        if timeout is None:
            return []
        due = []
        for group in self.open.values():
            if group.opened_at + timeout > now:
                break
            due.append(group.group_id)
        return due

    def expire(self, group_ids: Iterable[int], policy: TimeoutPolicy) -> list[Group]:
        """Time these incomplete groups out by ``policy``; returns those that became ready."""
        wanted = set(group_ids)
        became_ready = []
        for group in [g for g in self.open.values() if g.group_id in wanted]:
            if policy is TimeoutPolicy.DELIVER_PARTIAL:
                self._make_ready(group, complete=False)
                self.timed_out_delivered += 1
                became_ready.append(group)
            else:
                del self.open[group.instance_id]
                self._discard(group)
                self.timed_out_dropped += 1
        return became_ready

    # --------------------------------------------------------------- admin
    def delete_instance(self, instance_id: str) -> tuple[int, int]:
        """Forget the instance's groups, ready or not: (groups, trajectories) removed.
        Its uids stay known: a late retry of one is still a duplicate."""
        groups = [g for g in self.ready.values() if g.instance_id == instance_id]
        for group in groups:
            del self.ready[group.group_id]
        if (group := self.open.pop(instance_id, None)) is not None:
            groups.append(group)
        for group in groups:
            self._discard(group)
        return len(groups), sum(len(g.items) for g in groups)

    def reset(self) -> None:
        """Empty: groups, known uids and counters (the configuration stays)."""
        config, spill = self.config, self.spill
        spill.clear()
        self.__init__(config, spill)

    def configure(self, config: BufferConfig) -> None:
        self.config = config

    def _discard(self, group: Group) -> None:
        for item in group.items:
            if item.payload is None:
                self.spill.free(item.size)
            else:
                self.memory_bytes -= item.size

    # -------------------------------------------------------------- status
    def status(self, log_bytes: int = 0) -> BufferStatus:
        return BufferStatus(
            total_trajectories=self.total_trajectories,
            total_consumed=self.total_consumed,
            pending_groups=len(self.ready),
            incomplete_groups=len(self.open),
            memory_usage_bytes=self.memory_bytes,
            disk_usage_bytes=self.spill.file_bytes + log_bytes,
            duplicates_dropped=self.duplicates_dropped,
            groups_timed_out_delivered=self.timed_out_delivered,
            groups_timed_out_dropped=self.timed_out_dropped,
            writes_refused=self.writes_refused,
        )

    def groups(self) -> list[Group]:
        """Every group held: ready ones in delivery order, then incomplete ones oldest first."""
        return [*self.ready.values(), *self.open.values()]
