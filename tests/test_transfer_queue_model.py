"""The TransferQueue's semantics against a plain model, under random interleavings (hypothesis).

Writes with duplicate uids, reads, deletes, resets, config changes, and crash-restarts (the
service abandoned as ``kill -9`` leaves it, sometimes with a torn record at the log's end, and a
new one recovering from its directory), with a tiny compaction threshold so the log rotates
often. After every step the queue and the model agree on what is ready, incomplete and counted.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import msgspec
import uvloop
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from omni_engine.transfer_queue import records
from omni_engine.transfer_queue.data_model import BufferConfig, PayloadFormat, parse_trajectory
from omni_engine.transfer_queue.service import TransferQueueService

UIDS = st.sampled_from([f"u{i}" for i in range(40)])
INSTANCES = st.sampled_from(["a", "b", "c", "d"])


class Model:
    """The queue's contract, as plainly as it can be written."""

    def __init__(self) -> None:
        self.group_size, self.dedup = 3, True
        self.reset()

    def reset(self) -> None:
        self.seen: set[str] = set()
        self.open: dict[str, tuple[int, list[str]]] = {}  # instance -> (size, uids)
        self.ready: list[tuple[str, list[str]]] = []
        self.total = 0

    def write(self, uid: str, instance: str) -> bool:
        if self.dedup and uid in self.seen:
            return False
        size, uids = self.open.setdefault(instance, (self.group_size, []))
        uids.append(uid)
        if self.dedup:
            self.seen.add(uid)
        self.total += 1
        if len(uids) >= size:
            del self.open[instance]
            self.ready.append((instance, uids))
        return True

    def read(self, max_groups: int | None) -> list[tuple[str, list[str]]]:
        n = len(self.ready) if max_groups is None else max_groups
        taken, self.ready = self.ready[:n], self.ready[n:]
        return taken

    def delete(self, instance: str) -> tuple[int, int]:
        groups = [uids for inst, uids in self.ready if inst == instance]
        self.ready = [(inst, uids) for inst, uids in self.ready if inst != instance]
        if instance in self.open:
            groups.append(self.open.pop(instance)[1])
        return len(groups), sum(len(g) for g in groups)


def _item(uid: str, instance: str):
    return parse_trajectory(msgspec.msgpack.encode({"uid": uid, "instance_id": instance, "reward": 1.0,
                                                     "messages": [{"role": "assistant", "content": uid * 20}]}),
                            PayloadFormat.MSGPACK)


class TransferQueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = uvloop.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="tq-model-"))
        self.model = Model()
        self.service: TransferQueueService | None = None
        self.durability = "fsync"
        self.compact_min_bytes = 3000

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def _open(self) -> None:
        self.service = TransferQueueService(None, self.dir, self.durability, compact_min_bytes=self.compact_min_bytes)
        self.run(self.service.start())

    # A tiny compaction threshold rotates the log every few steps; a large one replays long histories.
    @initialize(durability=st.sampled_from(["fsync", "write"]), compact_min_bytes=st.sampled_from([3000, 1 << 20]))
    def start(self, durability: str, compact_min_bytes: int) -> None:
        self.durability, self.compact_min_bytes = durability, compact_min_bytes
        self._open()
        self.run(self.service.configure(BufferConfig(group_size=3)))

    @rule(batch=st.lists(st.tuples(UIDS, INSTANCES), min_size=1, max_size=6))
    def write(self, batch) -> None:
        result = self.run(self.service.write([_item(uid, inst) for uid, inst in batch]))
        accepted = sum(self.model.write(uid, inst) for uid, inst in batch)
        assert (result.written, result.duplicates, result.refused) == (accepted, len(batch) - accepted, 0)

    @rule(max_groups=st.none() | st.integers(1, 3))
    def read(self, max_groups) -> None:
        groups = self.run(self.service.read(max_groups))
        got = [(g.instance_id, [t.uid for t in g.items]) for g in groups]
        assert got == self.model.read(max_groups)
        for g in groups:  # the bytes come back as written
            assert all(msgspec.msgpack.decode(t.payload)["uid"] == t.uid for t in g.items)

    @rule(max_groups=st.none() | st.integers(1, 3), then=st.sampled_from(["release", "crash", "snapshot+crash"]))
    def read_never_acknowledged(self, max_groups, then) -> None:
        """A reader takes groups and vanishes: they go back to the front of the queue, whether the
        queue lives on (release) or crashes meanwhile (with a snapshot taken while they were out)."""
        delivery = self.run(self.service.take(max_groups))
        if delivery is None:
            assert not self.model.ready
            return
        assert [(g.instance_id, [t.uid for t in g.items]) for g in delivery.groups] == \
            self.model.ready[:len(delivery.groups)]
        if then == "release":
            self.service.release(delivery.delivery_id)
            return
        if then == "snapshot+crash":
            snapshot = records.snapshot_record(self.service.buffer, self.service.undelivered())

            async def rotate() -> None:
                await self.service.wal.rotate(snapshot)

            self.run(rotate())
        self.crash_and_recover(torn=False)

    @rule(instance=INSTANCES)
    def delete(self, instance) -> None:
        assert self.run(self.service.delete_instance(instance)) == self.model.delete(instance)

    @rule()
    def reset(self) -> None:
        self.run(self.service.reset())
        self.model.reset()

    @rule(group_size=st.integers(1, 4), dedup=st.booleans())
    def configure(self, group_size, dedup) -> None:
        self.run(self.service.configure(BufferConfig(group_size=group_size, uid_dedup=dedup)))
        # (With dedup off, uids are neither checked nor recorded: turned back on, those are unknown.)
        self.model.group_size, self.model.dedup = group_size, dedup

    @precondition(lambda self: self.service is not None)
    @rule(torn=st.booleans())
    def crash_and_recover(self, torn: bool) -> None:
        """kill -9: no close, no flush beyond what was acknowledged; maybe half a record at the end."""
        wal = self.service.wal
        if wal._flushing is not None:  # (a crash stops everything at once; the test cannot: let it end)
            self.run(asyncio.gather(wal._flushing, return_exceptions=True))
        wal._executor.shutdown(wait=True)
        os.close(wal._fd)
        os.close(wal._lock_fd)
        self.service.spill.close()
        if torn:
            segment = sorted(self.dir.glob("wal-*.log"))[-1]
            with open(segment, "ab") as f:
                f.write(b"\x40\x00\x00\x00\x99\x99\x99\x99\x01partial")
        self._open()

    @invariant()
    def agrees_with_the_model(self) -> None:
        if self.service is None:
            return
        status = self.service.status()
        assert status.pending_groups == len(self.model.ready)
        assert status.incomplete_groups == len(self.model.open)
        assert status.total_trajectories == self.model.total
        assert [(g.instance_id, [t.uid for t in g.items]) for g in self.service.buffer.ready.values()] == \
            self.model.ready

    def teardown(self) -> None:
        if self.service is not None:
            self.run(self.service.close())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TransferQueueMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_transfer_queue_matches_its_model = TransferQueueMachine.TestCase
