"""The write-ahead log: what makes an acknowledged write survive ``kill -9``.

Records are framed ``<u32 body length><u32 crc32><u8 type>body`` (the crc
covers type and body) and appended to a segment file ``wal-NNNNNNNN.log``.
Every segment starts with a SNAPSHOT of the whole buffer, so recovery reads one
segment: the newest whose snapshot is intact, up to its first torn record
(cut off there). Compaction is rotation: a new segment with a fresh snapshot,
after which the older ones are removed, so the log holds what is live, not its
history.

Group commit: ``append`` queues a record and returns a future; one writer
thread writes everything queued as one ``write`` and one ``fsync``, then
resolves the futures of that batch. While it syncs, new records queue for the
next batch, so an acknowledged write waits for at most two fsyncs however many
writers there are. With ``sync=False`` records are written at once without
fsync (they survive the process, not the machine).
"""

from __future__ import annotations

import asyncio
import enum
import fcntl
import logging
import mmap
import os
import re
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<IIB")
_SEGMENT = re.compile(r"^wal-(\d{8})\.log$")


class RecordType(enum.IntEnum):
    """Fixed values: they are on disk."""

    WRITE = 1  # WriteRecord: trajectories accepted (duplicates and refusals are not logged)
    CONSUME = 2  # ConsumeRecord: groups delivered to a reader
    EXPIRE = 3  # ExpireRecord: incomplete groups timed out, and by which policy
    DELETE = 4  # DeleteRecord: an instance's groups removed
    RESET = 5  # (empty body)
    CONFIG = 6  # BufferConfig
    RESTORE = 7  # RestoreRecord: consumed groups put back (their reader was gone)
    SNAPSHOT = 8  # Snapshot: the whole buffer, first record of every segment


class LogFailed(OSError):
    """The log could not be written: nothing is acknowledged any more (restart to recover)."""


def frame(rtype: RecordType, body: bytes) -> bytes:
    crc = zlib.crc32(body, zlib.crc32(bytes((rtype,))))
    return _HEADER.pack(len(body), crc, rtype) + body


def read_frames(data: memoryview) -> Iterator[tuple[int, RecordType, memoryview]]:
    """(end offset, type, body) of each intact record, in order; stops at the first torn one."""
    pos, n = 0, len(data)
    while pos + _HEADER.size <= n:
        length, crc, rtype = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + length
        if end > n:
            return
        body = data[pos + _HEADER.size:end]
        if zlib.crc32(body, zlib.crc32(bytes((rtype,)))) != crc:
            return
        try:
            kind = RecordType(rtype)
        except ValueError:
            return
        yield end, kind, body
        pos = end


def _segments(directory: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), directory / name) for name in os.listdir(directory)
             if (m := _SEGMENT.match(name))]
    return sorted(found)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Rotate:
    """A queued rotation: the records before it close the old segment, those after open the new."""

    def __init__(self, snapshot_frame: bytes) -> None:
        self.snapshot_frame = snapshot_frame


class WriteAheadLog:
    """One data directory's log. ``recover()`` first, then ``append`` / ``rotate``."""

    def __init__(self, directory: str | os.PathLike, sync: bool = True) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sync = sync
        self.generation = 0
        self.segment_bytes = 0  # bytes in the current segment (appended, maybe not yet written)
        self.failed: BaseException | None = None
        self._fd = -1
        self._lock_fd = -1
        self._pending: list[bytes | _Rotate] = []
        self._waiters: list[asyncio.Future] = []
        self._flushing: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tq-wal")

    # ------------------------------------------------------------- recovery
    def recover(self) -> Iterator[tuple[RecordType, memoryview]]:
        """The records to replay, snapshot first (nothing: a new directory). Afterwards the log
        is open for appending behind the last intact record; older segments are removed."""
        self._lock()
        segments = _segments(self.directory)
        chosen = None
        for gen, path in reversed(segments):
            first = self._first_record(path)
            if first is not None and first[1] is RecordType.SNAPSHOT:
                chosen = (gen, path)
                break
            logger.warning("transfer queue log: segment %s has no intact snapshot; ignored", path.name)
        for gen, path in segments:
            if chosen is None or gen != chosen[0]:
                path.unlink()
        if chosen is None:
            return
        self.generation, path = chosen
        end = 0
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
            view = memoryview(mm) if mm is not None else memoryview(b"")
            frames = read_frames(view)
            try:
                for end, rtype, body in frames:
                    yield rtype, body
                    body.release()  # (the map cannot close while a view of it lives)
            finally:
                frames.close()
                view.release()
                if mm is not None:
                    try:
                        mm.close()
                    except BufferError:  # a caller kept a view: the map goes with it
                        pass
        if end < size:
            logger.warning("transfer queue log: %s cut at byte %d of %d (a record torn by a crash)",
                           path.name, end, size)
            os.truncate(path, end)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self.segment_bytes = end

    def _lock(self) -> None:
        """One queue per directory: a second would interleave its records with ours."""
        self._lock_fd = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise LogFailed(f"data directory {self.directory} is in use by another transfer queue "
                            f"(pid {holder})") from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, str(os.getpid()).encode(), 0)

    @staticmethod
    def _first_record(path: Path) -> tuple[int, RecordType, memoryview] | None:
        data = path.read_bytes()
        return next(read_frames(memoryview(data)), None)

    def start(self, snapshot_frame: bytes) -> None:
        """For a directory without a log: the first segment, starting from ``snapshot_frame``."""
        self.generation += 1
        self._fd, self.segment_bytes = self._new_segment(self.generation, snapshot_frame)

    def _new_segment(self, generation: int, snapshot_frame: bytes) -> tuple[int, int]:
        path = self.directory / f"wal-{generation:08d}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        _write_all(fd, snapshot_frame)
        os.fsync(fd)
        _fsync_dir(self.directory)
        return fd, len(snapshot_frame)

    # --------------------------------------------------------------- append
    def append(self, record: bytes) -> asyncio.Future | None:
        """Queue a framed record; the future resolves once it is on disk (None: nothing to
        wait for, ``sync`` is off and it is written already). Raises ``LogFailed``."""
        if self.failed is not None:
            raise LogFailed(f"transfer queue log failed earlier: {self.failed}")
        self.segment_bytes += len(record)
        if not self.sync and self._flushing is None:  # (else behind a rotation, in order)
            try:
                _write_all(self._fd, record)
            except OSError as exc:
                self.failed = exc
                raise LogFailed(f"transfer queue log: write failed: {exc}") from exc
            return None
        return self._queue(record)

    def rotate(self, snapshot_frame: bytes) -> asyncio.Future:
        """Start a new segment from ``snapshot_frame`` (the state after everything appended so
        far); the older segments go once it is on disk."""
        if self.failed is not None:
            raise LogFailed(f"transfer queue log failed earlier: {self.failed}")
        self.segment_bytes = len(snapshot_frame)
        return self._queue(_Rotate(snapshot_frame))

    def _queue(self, item: bytes | _Rotate) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append(item)
        self._waiters.append(future)
        if self._flushing is None:
            self._flushing = loop.create_task(self._flush())
        return future

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                items, waiters = self._pending, self._waiters
                self._pending, self._waiters = [], []
                try:
                    await loop.run_in_executor(self._executor, self._write_batch, items)
                except OSError as exc:
                    self.failed = exc
                    logger.error("transfer queue log: write failed: %s; writes are refused from now on", exc)
                    for future in (*waiters, *self._waiters):
                        if not future.done():
                            future.set_exception(LogFailed(f"transfer queue log: write failed: {exc}"))
                    self._pending, self._waiters = [], []
                    return
                for future in waiters:
                    if not future.done():
                        future.set_result(None)
        finally:
            self._flushing = None

    def _write_batch(self, items: list[bytes | _Rotate]) -> None:
        """(Writer thread.) Write, fsync; a rotation closes the segment and opens the next."""
        run: list[bytes] = []
        for item in items:
            if isinstance(item, _Rotate):
                self._write_run(run)
                run = []
                old = self._fd
                self.generation += 1
                self._fd, _ = self._new_segment(self.generation, item.snapshot_frame)
                os.close(old)
                for gen, path in _segments(self.directory):
                    if gen < self.generation:
                        path.unlink()
            else:
                run.append(item)
        self._write_run(run)

    def _write_run(self, run: list[bytes]) -> None:
        if run:
            _write_all(self._fd, b"".join(run))
            if self.sync:
                os.fsync(self._fd)

    # ---------------------------------------------------------------- close
    async def close(self) -> None:
        """Wait for what is queued, then close."""
        if self._flushing is not None:
            await asyncio.gather(self._flushing, return_exceptions=True)
        self._executor.shutdown(wait=True)
        if self._fd >= 0:
            if self.failed is None:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # (releases the lock)
            self._lock_fd = -1

    def disk_bytes(self) -> int:
        return self.segment_bytes


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
