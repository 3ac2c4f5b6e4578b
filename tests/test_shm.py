"""Shared-memory pool, segments, stale-segment cleanup and the consumer's lease book.

Real segments in /dev/shm (or a temporary directory standing in for it), a real
event loop for the lease book; no mocks.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import resource
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_engine.connectors.leases import ShmLeaseBook
from omni_engine.connectors import shm
from omni_engine.connectors.shm import (
    SEGMENT_INDEX,
    ShmAttachments,
    ShmPool,
    ShmSegment,
    list_segments,
    new_run_prefix,
    remove_stale_segments,
    stage_prefix,
    unlink_prefix,
)
from omni_engine.outputs import OmniRequestOutput
from omni_engine.wire.stage_serialization import (
    StageMsgpackDecoder,
    StageMsgpackEncoder,
)

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")

KIB = 1024
SHM_LOGGER = "omni_engine.connectors.shm"


@pytest.fixture
def prefix():
    p = stage_prefix(new_run_prefix(), 0)
    yield p
    leftover = list_segments(p)
    unlink_prefix(p)
    assert not leftover, f"segments left behind: {leftover}"


@pytest.fixture
def pool(prefix):
    p = ShmPool(prefix, max_bytes=1 << 20, min_slot=4 * KIB)
    yield p
    p.close()


def shm_path(name: str):
    return shm.SHM_DIR / name


def mapped(name_part: str) -> bool:
    """Whether this process still maps a segment whose name contains ``name_part``."""
    return name_part in _maps()


def _maps() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == SHM_LOGGER and r.levelno == logging.WARNING]


# ----------------------------------------------------------------- the pool
def test_names_carry_pid_and_stage():
    run = new_run_prefix()
    assert run.startswith(f"omni_{os.getpid()}_") and run != new_run_prefix()
    assert stage_prefix(run, 3) == f"{run}_s3"


@pytest.mark.parametrize(
    "nbytes, slot", [(0, 4 * KIB), (1, 4 * KIB), (4 * KIB, 4 * KIB), (4 * KIB + 1, 8 * KIB),
                     (5000, 8 * KIB), (8 * KIB, 8 * KIB), (100 * KIB, 128 * KIB), (128 * KIB + 1, 256 * KIB)]
)
def test_slots_are_power_of_two_size_classes(pool, nbytes, slot):
    segment = pool.lease(nbytes, "r")
    assert segment.size == slot and segment.size >= nbytes
    assert segment.name.startswith(pool.prefix + "_")
    assert os.path.getsize(shm_path(segment.name)) == slot
    assert segment.array.nbytes == slot and pool.total_bytes == slot


def test_released_slot_comes_back_for_the_same_size_class(pool):
    a = pool.lease(5000, "r1")
    b = pool.lease(3000, "r1")
    c = pool.lease(6000, "r2")
    assert len({a.name, b.name, c.name}) == 3
    assert pool.num_leased() == 3 and sorted(pool.leases_of("r1")) == sorted([a.name, b.name])
    assert pool.leases_of("r2") == [c.name]
    a.array[:5] = [1, 2, 3, 4, 5]

    assert pool.release([a.name, "omni_unknown_0", a.name]) == 1  # unknown and repeated names ignored
    assert pool.num_leased() == 2 and pool.leases_of("r1") == [b.name]
    again = pool.lease(7000, "r3")  # same 8 KiB class: the released slot, not a new segment
    assert again is a and again.name == a.name
    assert list(again.array[:5]) == [1, 2, 3, 4, 5]  # recycled, not recreated
    assert pool.leases_of("r3") == [a.name]
    other = pool.lease(5 * KIB, "r4")
    assert other.name not in (a.name, b.name, c.name)  # nothing of that class is free
    assert pool.total_bytes == 8 * KIB + 4 * KIB + 8 * KIB + 8 * KIB
    assert len(list_segments(pool.prefix)) == 4


def test_pool_limit_falls_back_with_one_warning(prefix, caplog):
    caplog.set_level(logging.WARNING, logger=SHM_LOGGER)
    pool = ShmPool(prefix, max_bytes=16 * KIB, min_slot=4 * KIB)
    try:
        a = pool.lease(8 * KIB, "r")
        b = pool.lease(8 * KIB, "r")
        assert a is not None and b is not None and pool.total_bytes == 16 * KIB
        assert pool.lease(4 * KIB, "r") is None
        assert pool.lease(1, "r") is None
        assert pool.lease(64 * KIB, "r") is None
        assert len(warnings_of(caplog)) == 1
        assert "pool limit" in warnings_of(caplog)[0].getMessage()
        assert pool.num_leased() == 2 and pool.total_bytes == 16 * KIB

        # A free slot of another size class is evicted to make room.
        pool.release([a.name])
        c = pool.lease(4 * KIB, "r")
        assert c is not None and c.size == 4 * KIB
        assert not shm_path(a.name).exists()
        assert pool.total_bytes == 12 * KIB
        assert len(warnings_of(caplog)) == 1
    finally:
        pool.close()


def test_an_oversized_lease_keeps_the_free_slots(prefix):
    pool = ShmPool(prefix, max_bytes=16 * KIB, min_slot=4 * KIB)
    try:
        a = pool.lease(8 * KIB, "r")
        pool.release([a.name])
        assert pool.lease(1 << 20, "r") is None  # can never fit: do not flush the pool for it
        assert shm_path(a.name).exists()
        assert pool.lease(8 * KIB, "r") is a
    finally:
        pool.close()


def test_segment_in_missing_directory_is_an_os_error_and_lease_falls_back(prefix, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger=SHM_LOGGER)
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path / "missing")
    with pytest.raises(OSError):
        ShmSegment.create(f"{prefix}_x", 4 * KIB)
    pool = ShmPool(prefix, max_bytes=1 << 20, min_slot=4 * KIB)
    try:
        assert pool.lease(4 * KIB, "r") is None
        assert pool.lease(4 * KIB, "r") is None
        [warning] = warnings_of(caplog)
        assert "cannot create segment" in warning.getMessage() and "--shm-size" in warning.getMessage()
        assert pool.num_leased() == 0 and pool.total_bytes == 0

        # The encoder then sends the tensor as a frame.
        enc = StageMsgpackEncoder(shm_pool=pool, inline_threshold=64, shm_threshold=4 * KIB)
        t = torch.arange(2048, dtype=torch.float32)
        bufs = enc.encode(t, owner="r")
        assert len(bufs) == 2 and torch.equal(StageMsgpackDecoder().decode(bufs), t)
    finally:
        pool.close()


def test_full_shm_directory_falls_back_instead_of_crashing(prefix, caplog):
    """A tmpfs too small for the slot: fallocate fails (here: EFBIG from RLIMIT_FSIZE)."""
    caplog.set_level(logging.WARNING, logger=SHM_LOGGER)
    pool = ShmPool(prefix, max_bytes=1 << 30, min_slot=4 * KIB)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        small = pool.lease(4 * KIB, "r")
        assert small is not None
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * KIB, hard))
        try:
            with pytest.raises(OSError):
                ShmSegment.create(f"{prefix}_direct", 1 << 20)
            assert pool.lease(1 << 20, "r") is None
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        [warning] = warnings_of(caplog)
        assert "cannot create segment" in warning.getMessage()
        # The failed segments' files were removed, the working one stays.
        assert list_segments(prefix) == [small.name]
        assert pool.num_leased() == 1
        assert pool.lease(1 << 20, "r") is not None  # room again: works again
    finally:
        signal.signal(signal.SIGXFSZ, old_handler)
        pool.close()


def test_close_unlinks_everything(prefix):
    pool = ShmPool(prefix, max_bytes=1 << 20, min_slot=4 * KIB)
    leased = pool.lease(4 * KIB, "r")
    free = pool.lease(16 * KIB, "r")
    pool.release([free.name])
    view = np.frombuffer(leased.array, dtype=np.uint8)  # a live view must not stop close()
    assert len(list_segments(prefix)) == 2
    assert SEGMENT_INDEX.find(leased.address, 16) == (leased.name, 0)
    pool.close()
    assert list_segments(prefix) == []
    assert pool.num_leased() == 0 and pool.total_bytes == 0
    assert SEGMENT_INDEX.find(leased.address + 8, 8) is None
    assert pool.lease(4 * KIB, "r") is None  # closed
    assert pool.release([leased.name]) == 0
    view[0] = 7  # the mapping outlives close() while a view holds it
    assert mapped(leased.name) and not mapped(free.name)  # the free slot had no view: unmapped now
    del view, leased, free
    gc.collect()
    assert not mapped(f"{prefix}_")  # the last view took the mapping with it


def test_attachments_map_the_same_bytes_and_detach(pool):
    seg = pool.lease(4 * KIB, "r")
    seg.array[:3] = [9, 8, 7]
    att = ShmAttachments()
    try:
        view = att.view(seg.name, 0, 3)
        assert bytes(view) == b"\x09\x08\x07" and len(att) == 1
        assert att.view(seg.name, 1, 2).tobytes() == b"\x08\x07" and len(att) == 1  # cached
        seg.array[0] = 1
        assert view[0] == 1  # shared, not copied
        with pytest.raises(ValueError, match="outside segment"):
            att.view(seg.name, 4 * KIB - 1, 2)
        with pytest.raises(ValueError, match="invalid shared-memory segment name"):
            att.view("../passwd", 0, 1)
        del view
        assert mapped(seg.name)
    finally:
        att.detach()
    assert len(att) == 0
    gc.collect()
    maps = _maps()
    assert maps.count(f"/{seg.name}") == 1  # the producer's mapping only; the consumer's is gone


# -------------------------------------------------------- stale segments
def _dead_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    for pid in range(pid_max - 1, 1, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise RuntimeError("no unused pid")


def _make_files(directory, names):
    for name in names:
        (directory / name).write_bytes(b"\0" * 16)


def test_remove_stale_segments_of_dead_runs_only(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    dead = _dead_pid()
    dead_names = [f"omni_{dead}_0badc0de_s0_0", f"omni_{dead}_0badc0de_s1_12"]
    live_names = [f"omni_{os.getpid()}_12345678_s0_0", "omni_1_abcdef01_s0_0"]  # us; pid 1 always lives
    other = ["omni_garbage", "not_ours", f"omni_{dead}_nothex_s0_0"]
    _make_files(tmp_path, dead_names + live_names + other)
    removed = remove_stale_segments()
    assert sorted(removed) == sorted(dead_names)
    assert sorted(os.listdir(tmp_path)) == sorted(live_names + other)
    assert remove_stale_segments() == []


def test_remove_stale_segments_in_dev_shm():
    dead = _dead_pid()
    name = f"omni_{dead}_0badc0de_s0_0"
    seg = ShmSegment.create(name, 4 * KIB)
    try:
        live = stage_prefix(new_run_prefix(), 0) + "_0"
        mine = ShmSegment.create(live, 4 * KIB)
        try:
            removed = remove_stale_segments()
            assert name in removed and not shm_path(name).exists()
            assert shm_path(live).exists()
        finally:
            mine.unlink()
            mine.close()
    finally:
        seg.unlink()
        seg.close()


def test_unlink_prefix_matches_whole_components(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    run = "omni_5_abcdef01"
    s1 = [f"{run}_s1_0", f"{run}_s1_17"]
    s10 = [f"{run}_s10_0"]
    _make_files(tmp_path, s1 + s10 + [f"{run}_s2_0"])
    assert sorted(unlink_prefix(f"{run}_s1")) == sorted(s1)  # not stage 10's
    assert sorted(os.listdir(tmp_path)) == sorted(s10 + [f"{run}_s2_0"])
    assert unlink_prefix(f"{run}_s1") == []
    assert sorted(unlink_prefix(run)) == sorted(s10 + [f"{run}_s2_0"])
    assert os.listdir(tmp_path) == []


def test_detach_by_prefix_matches_whole_components(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    a = ShmPool("omni_5_abcdef01_s1", max_bytes=1 << 20, min_slot=4 * KIB)
    b = ShmPool("omni_5_abcdef01_s10", max_bytes=1 << 20, min_slot=4 * KIB)
    att = ShmAttachments()
    try:
        sa, sb = a.lease(1, "r"), b.lease(1, "r")
        att.view(sa.name, 0, 1)
        att.view(sb.name, 0, 1)
        att.detach(prefix="omni_5_abcdef01_s1")
        assert len(att) == 1
        att.detach(names=[sb.name])
        assert len(att) == 0
    finally:
        att.detach()
        a.close()
        b.close()
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------- lease book
async def spin() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Producer:
    """A real pool and encoder, with the release function the lease book calls."""

    def __init__(self, run: str, stage_id: int) -> None:
        self.run = run
        self.prefix = prefix = stage_prefix(run, stage_id)
        self.pool = ShmPool(prefix, max_bytes=4 << 20, min_slot=4 * KIB)
        self.encoder = StageMsgpackEncoder(shm_pool=self.pool, inline_threshold=64, shm_threshold=4 * KIB)
        self.released: list[list[str]] = []
        self.release_threads: list[int] = []
        self.release_loops: list[asyncio.AbstractEventLoop] = []

    def release(self, names: list[str]) -> None:
        self.release_threads.append(threading.get_ident())
        self.release_loops.append(asyncio.get_running_loop())
        self.released.append(list(names))
        self.pool.release(names)

    def output(self, request_id: str, n: int = 4096) -> list:
        out = OmniRequestOutput(request_id, finished=True, final_output_type="audio",
                                multimodal_output={"audio": torch.arange(n, dtype=torch.float32)})
        return self.encoder.encode(out)


@pytest.fixture
async def book_env():
    loop = asyncio.get_running_loop()
    book = ShmLeaseBook(loop)
    producer = Producer(new_run_prefix(), 1)
    book.add_producer(producer.prefix, producer.release)
    attachments = ShmAttachments()
    decoder = StageMsgpackDecoder(shm=attachments, on_shm_view=book.on_view)
    yield loop, book, producer, decoder
    gc.collect()
    attachments.detach()
    producer.pool.close()
    assert list_segments(producer.prefix) == []


async def test_slot_released_only_after_request_end_and_last_view(book_env):
    loop, book, producer, decoder = book_env
    out = decoder.decode(producer.output("req-A"))
    [name] = producer.pool.leases_of("req-A")
    audio = out.multimodal_output["audio"]
    derived = audio[100:200]            # torch view
    as_int = derived.view(torch.int32)  # a view of a view
    np_view = as_int.numpy()[::2]       # numpy view of the torch view
    del out, audio, derived, as_int
    gc.collect()
    await spin()
    assert book.num_tracked() == 1 and producer.released == []

    book.end_request("req-A")
    gc.collect()
    await spin()
    assert producer.released == []  # the numpy view still reads the slot
    assert producer.pool.num_leased() == 1
    assert int(np_view[0]) == int(torch.tensor(100.0).view(torch.int32))

    del np_view
    gc.collect()
    await spin()
    assert producer.released == [[name]]
    assert producer.release_loops == [loop] and producer.release_threads == [threading.get_ident()]
    assert producer.pool.num_leased() == 0 and book.num_tracked() == 0


async def test_views_dropped_first_then_request_end(book_env):
    _, book, producer, decoder = book_env
    first = decoder.decode(producer.output("req-B"))
    second = decoder.decode(producer.output("req-B", n=8192))
    names = sorted(producer.pool.leases_of("req-B"))
    assert len(names) == 2
    del first, second
    gc.collect()
    await spin()
    assert producer.released == []  # the request may still forward the handles
    book.end_request("req-B")
    await spin()
    assert [sorted(n) for n in producer.released] == [names]  # one batch
    assert producer.pool.num_leased() == 0
    book.end_request("req-B")  # idempotent
    await spin()
    assert len(producer.released) == 1


async def test_last_view_dropped_in_another_thread_releases_on_the_loop(book_env):
    loop, book, producer, decoder = book_env
    holder = [decoder.decode(producer.output("req-C")).multimodal_output["audio"][5:]]
    book.end_request("req-C")
    await spin()
    assert producer.released == []

    def drop() -> None:
        holder.clear()
        gc.collect()

    await asyncio.to_thread(drop)
    await spin()
    assert len(producer.released) == 1
    assert producer.release_threads == [threading.get_ident()] and producer.release_loops == [loop]


async def test_views_without_owner_are_released_when_dropped(book_env):
    _, book, producer, decoder = book_env
    t = decoder.decode(producer.encoder.encode(torch.ones(4096)))  # no request owns it
    assert book.num_tracked() == 1
    del t
    gc.collect()
    await spin()
    assert len(producer.released) == 1 and producer.pool.num_leased() == 0


async def test_remove_producer_forgets_its_segments(book_env):
    _, book, producer, decoder = book_env
    other = Producer(producer.run, 10)  # "<run>_s10": must not be confused with "<run>_s1"
    book.add_producer(other.prefix, other.release)
    try:
        kept = decoder.decode(producer.output("req-D"))
        gone = decoder.decode(other.output("req-D"))
        assert book.num_tracked() == 2

        book.remove_producer(other.prefix)  # the stage died
        assert book.num_tracked() == 1
        del gone
        book.end_request("req-D")
        gc.collect()
        await spin()
        assert other.released == []  # forgotten: its segments are unlinked by prefix instead
        assert producer.released == []  # ours still has a live view
        del kept
        gc.collect()
        await spin()
        assert len(producer.released) == 1 and book.num_tracked() == 0

        # A release already queued for a producer that dies before the flush is dropped.
        third = Producer(producer.run, 2)
        book.add_producer(third.prefix, third.release)
        v = decoder.decode(third.output("req-E"))
        book.end_request("req-E")
        del v
        gc.collect()  # queued, flush not yet run
        book.remove_producer(third.prefix)
        await spin()
        assert third.released == []
        third.pool.close()
    finally:
        other.pool.close()


def test_semaphores_no_process_maps_are_removed_and_no_other(tmp_path):
    """A named semaphore whose process died with its resource tracker (``kill -9`` of a whole
    job) is removed by the next client; one a live process holds, or a young one, is not."""
    import multiprocessing
    import subprocess
    import sys

    from omni_engine.connectors.semaphores import orphan_semaphores, remove_orphan_semaphores

    name = f"mp-omnitest{os.getpid()}"
    # A process that makes the semaphore and dies without unlinking it (no tracker: it is killed too).
    subprocess.run([sys.executable, "-c", f"import _multiprocessing; s = _multiprocessing.SemLock(1, 1, 1, "
                                          f"'/{name}', False); import os; os._exit(0)"], check=True)
    orphan = Path(f"/dev/shm/sem.{name}")
    assert orphan.exists()
    held = multiprocessing.get_context("spawn").Lock()  # this process maps it
    held_path = Path("/dev/shm/sem" + held._semlock.name.replace("/", "."))
    try:
        assert orphan not in orphan_semaphores()  # young: a tracker may be about to unlink it
        old = time.time() - 3600
        for path in (orphan, held_path):
            os.utime(path, (old, old))
        found = orphan_semaphores()
        assert orphan in found and held_path not in found
        assert orphan.name in remove_orphan_semaphores()
        assert not orphan.exists() and held_path.exists()
    finally:
        orphan.unlink(missing_ok=True)
