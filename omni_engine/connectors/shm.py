"""POSIX shared memory for large tensors: a leased, recycled pool of segments.

Measured here (ARCHITECTURE.md): a reused, already-touched segment moves 64 MiB
at ~16 GB/s, a fresh segment per tensor at ~1.2 GB/s because first-touch page
faults dominate. So a producer keeps a pool of pre-faulted segments, leases one
per large tensor of a request, and gets it back when the client says the
request's consumers are done with it (``RELEASE``), instead of creating and
unlinking a segment per tensor.

Segments are files in ``/dev/shm`` named ``<run prefix>_s<stage>_<n>``, where
the run prefix holds the client's pid: segments of a dead run can be found and
removed at the next start, and a dead stage's segments by its prefix.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omni_engine.connectors.settings import DEFAULT_SHM_POOL_BYTES, DEFAULT_SHM_THRESHOLD

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "omni_"
# Where POSIX shared memory lives on Linux (tmpfs). A module constant, read at
# call time, so tests can point it at a directory of their own.
SHM_DIR = Path("/dev/shm")
_RUN_RE = re.compile(r"^omni_(\d+)_[0-9a-f]+_")


def new_run_prefix() -> str:
    """A prefix unique to this process and run; the pid makes staleness checkable."""
    return f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"


def stage_prefix(run_prefix: str, stage_id: int) -> str:
    return f"{run_prefix}_s{stage_id}"


_STAGE_PREFIX_RE = re.compile(r"^omni_\d+_[0-9a-f]+_s\d+$")


def is_stage_prefix(prefix: str) -> bool:
    """Whether ``prefix`` has the shape :func:`stage_prefix` gives (``omni_<pid>_<hex>_s<id>``)."""
    return isinstance(prefix, str) and _STAGE_PREFIX_RE.match(prefix) is not None


def process_prefix(pid: int | None = None) -> str:
    """``omni_<pid>_``: every segment made for the client process ``pid`` (default: this one).

    A pipeline's stages have their own run prefixes, but all of them hold the
    client's pid, so this is what a decoder may attach: the segments of its
    own pipeline, and nothing else in /dev/shm.
    """
    return f"{SEGMENT_PREFIX}{os.getpid() if pid is None else pid}_"


def owner_process_prefix(prefix: str) -> str:
    """The :func:`process_prefix` of the client that made ``prefix`` (a run or stage prefix).

    A prefix not made by :func:`new_run_prefix` falls back to every segment of
    ours (``omni_``).
    """
    match = _RUN_RE.match(prefix + "_")
    return process_prefix(int(match.group(1))) if match else SEGMENT_PREFIX


def check_segment_name(name: str) -> None:
    """ValueError unless ``name`` is a plain file name of ours (no path, no NUL)."""
    if not isinstance(name, str) or "/" in name or "\0" in name or not name.startswith(SEGMENT_PREFIX):
        raise ValueError(f"invalid shared-memory segment name {name!r}")


class ShmSegment:
    """One shared-memory segment mapped into this process."""

    __slots__ = ("name", "size", "_mmap", "array", "address", "__weakref__")

    def __init__(self, name: str, size: int, mm: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self._mmap = mm
        # A uint8 view of the whole mapping: gives the base address for the
        # segment index and slices for zero-copy views.
        self.array = np.frombuffer(mm, dtype=np.uint8, count=size)
        self.address = int(self.array.ctypes.data)

    @classmethod
    def create(cls, name: str, size: int) -> "ShmSegment":
        """Create and pre-fault a segment.

        ``posix_fallocate`` reserves tmpfs pages up front, so a full
        ``/dev/shm`` is an ``OSError`` here rather than a SIGBUS on first write;
        ``MAP_POPULATE`` maps them in now rather than fault by fault later.
        """
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.unlink(path)
                raise
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        return cls(name, size, mm)

    @classmethod
    def attach(cls, name: str) -> "ShmSegment":
        """Map an existing segment (the consumer side)."""
        check_segment_name(name)
        # O_NOFOLLOW: a symlink planted in /dev/shm must not map another file.
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"shared-memory segment {name!r} is not a regular file")
            size = st.st_size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        return cls(name, size, mm)

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"range [{offset}, {offset + nbytes}) is outside segment {self.name!r} "
                f"of {self.size} bytes"
            )
        return memoryview(self._mmap)[offset : offset + nbytes]

    def unlink(self) -> None:
        try:
            os.unlink(SHM_DIR / self.name)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap now if no view is alive; otherwise the last view's death does it."""
        self.array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass


class SegmentIndex:
    """Address ranges of every segment mapped in this process.

    Lets the encoder recognise that a tensor already lives in shared memory
    (a slot it leased, or a view it decoded) and send its handle instead of
    its bytes: zero-copy forwarding between stages.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._segments: list[ShmSegment] = []

    def add(self, segment: ShmSegment) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, segment.address)
            self._starts.insert(i, segment.address)
            self._segments.insert(i, segment)

    def remove(self, segment: ShmSegment) -> None:
        with self._lock:
            for i, seg in enumerate(self._segments):
                if seg is segment:
                    del self._starts[i], self._segments[i]
                    return

    def find(self, address: int, nbytes: int) -> tuple[str, int] | None:
        """``(segment name, offset)`` if ``[address, address+nbytes)`` is in one segment."""
        if not self._starts:
            return None
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return None
            seg = self._segments[i]
            if address + nbytes <= seg.address + seg.size:
                return seg.name, address - seg.address
        return None


SEGMENT_INDEX = SegmentIndex()

# The pool of the stage this process serves and its shm threshold (set by the
# stage process), for models that write large outputs straight into shared memory.
_output_pool: "ShmPool | None" = None
_output_threshold: int = DEFAULT_SHM_THRESHOLD


def set_output_pool(pool: "ShmPool | None", shm_threshold: int = DEFAULT_SHM_THRESHOLD) -> None:
    global _output_pool, _output_threshold
    _output_pool, _output_threshold = pool, shm_threshold


def output_pool_prefix() -> str | None:
    """The segment prefix of this stage process's pool (None outside a stage, or without shm)."""
    return _output_pool.prefix if _output_pool is not None else None


def stage_file_prefix(kind: str) -> str:
    """A name prefix for files of ``kind`` a stage process keeps in ``SHM_DIR`` besides its pool's
    segments (its pool's prefix where it has one: the client's clean-up of a dead stage or run
    finds them too)."""
    return f"{output_pool_prefix() or new_run_prefix()}_{kind}"


def empty_output(nbytes: int, request_id: str) -> np.ndarray:
    """An uninitialised uint8 buffer for an output of ``request_id``.

    In a stage process with shared memory on, and at least the shm threshold
    in size, it is a slot of the stage's pool: a tensor or array viewing it is
    sent as a handle with no copy at all (``torch.frombuffer(buf, dtype=...)``
    or ``buf.view(dtype)``). Elsewhere, ordinary memory. A slot whose output is
    never sent goes back to the pool when the request ends.
    """
    pool = _output_pool
    if pool is not None and nbytes >= _output_threshold:
        segment = pool.lease(nbytes, request_id, sent=False)
        if segment is not None:
            return segment.array[:nbytes]
    return np.empty(nbytes, dtype=np.uint8)


@dataclass(slots=True)
class _Lease:
    segment: ShmSegment
    owner: str
    # False for a slot handed to a model to write an output into (empty_output)
    # until the encoder sends its handle; unsent slots go back when the request ends.
    sent: bool = True


class ShmPool:
    """A producer's pool of pre-faulted segments, leased per request.

    Slots come in power-of-two sizes (at least ``min_slot``) so a released slot
    fits the next tensor of similar size. The pool never holds more than
    ``max_bytes``; past that (or when /dev/shm is full) ``lease`` returns None
    and the caller sends the tensor as a ZMQ frame instead.
    """

    def __init__(self, prefix: str, max_bytes: int = DEFAULT_SHM_POOL_BYTES, min_slot: int = 1 << 20) -> None:
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.min_slot = min_slot
        self._lock = threading.Lock()
        self._free: dict[int, list[ShmSegment]] = {}
        self._leased: dict[str, _Lease] = {}
        # Owner -> names of its slots not sent yet. Read without the lock by the stage, which
        # only asks whether a finished request has any (a dict lookup is atomic).
        self.unsent: dict[str, set[str]] = {}
        self._total = 0
        self._counter = 0
        self._warned = False
        self._closed = False

    @property
    def total_bytes(self) -> int:
        return self._total

    def num_leased(self) -> int:
        return len(self._leased)

    def lease(self, nbytes: int, owner: str, sent: bool = True) -> ShmSegment | None:
        size = max(self.min_slot, 1 << max(0, nbytes - 1).bit_length())
        with self._lock:
            if self._closed:
                return None
            free = self._free.get(size)
            segment = free.pop() if free else self._create_locked(size)
            if segment is not None:
                self._leased[segment.name] = _Lease(segment, owner, sent)
                if not sent:
                    self.unsent.setdefault(owner, set()).add(segment.name)
            return segment

    def mark_sent(self, name: str) -> None:
        """The handle of a leased slot left for the client: from now on the client frees it."""
        with self._lock:
            lease = self._leased.get(name)
            if lease is not None and not lease.sent:
                lease.sent = True
                self._forget_unsent(lease.owner, name)

    def release_unsent(self, owner: str) -> int:
        """Take back the slots of a finished request that were never sent (e.g. it failed)."""
        with self._lock:
            names = list(self.unsent.get(owner, ()))
        return self.release(names) if names else 0

    def _forget_unsent(self, owner: str, name: str) -> None:
        names = self.unsent.get(owner)
        if names is not None:
            names.discard(name)
            if not names:
                del self.unsent[owner]

    def _create_locked(self, size: int) -> ShmSegment | None:
        free_bytes = sum(slot * len(free) for slot, free in self._free.items())
        if self._total - free_bytes + size > self.max_bytes:
            # Evicting every free slot would not make room: keep them warm.
            return self._fallback(f"pool limit of {self.max_bytes} bytes reached")
        self._evict_locked(self._total + size - self.max_bytes)
        if self._total + size > self.max_bytes:
            return self._fallback(f"pool limit of {self.max_bytes} bytes reached")
        name = f"{self.prefix}_{self._counter}"
        self._counter += 1
        try:
            segment = ShmSegment.create(name, size)
        except OSError as exc:
            return self._fallback(f"cannot create segment {name!r} of {size} bytes: {exc}")
        SEGMENT_INDEX.add(segment)
        self._total += size
        return segment

    def _evict_locked(self, need: int) -> None:
        """Unlink free slots (largest first) until ``need`` bytes are free."""
        for size in sorted(self._free, reverse=True):
            free = self._free[size]
            while free and need > 0:
                self._destroy(free.pop())
                need -= size

    def _fallback(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "shared memory unavailable (%s); large tensors go as ZMQ frames. "
                "In containers give /dev/shm room with --shm-size or --ipc=host.", why
            )
        return None

    def release(self, names: list[str]) -> int:
        """Return leased slots to the pool; unknown names are ignored."""
        released = 0
        with self._lock:
            for name in names:
                lease = self._leased.pop(name, None)
                if lease is None:
                    continue
                if not lease.sent:
                    self._forget_unsent(lease.owner, name)
                released += 1
                if self._closed:
                    self._destroy(lease.segment)
                else:
                    self._free.setdefault(lease.segment.size, []).append(lease.segment)
        return released

    def leased_segment(self, name: str) -> ShmSegment | None:
        """The leased slot named ``name`` (None: not leased)."""
        lease = self._leased.get(name)
        return lease.segment if lease is not None else None

    def leases_of(self, owner: str) -> list[str]:
        with self._lock:
            return [name for name, lease in self._leased.items() if lease.owner == owner]

    def _destroy(self, segment: ShmSegment) -> None:
        SEGMENT_INDEX.remove(segment)
        segment.unlink()
        segment.close()
        self._total -= segment.size

    def close(self) -> None:
        """Unlink every segment; mappings die with their last view."""
        with self._lock:
            self._closed = True
            for free in self._free.values():
                for segment in free:
                    self._destroy(segment)
            self._free.clear()
            for lease in self._leased.values():
                self._destroy(lease.segment)
            self._leased.clear()
            self.unsent.clear()


class ShmAttachments:
    """A consumer's cache of attached segments (mapping is costly; reuse it).

    Only segments under ``allowed_prefix`` are attached: a handle comes off a
    socket, and must not map an arbitrary segment of another program or run.
    """

    def __init__(self, allowed_prefix: str = SEGMENT_PREFIX) -> None:
        if not allowed_prefix.startswith(SEGMENT_PREFIX):
            raise ValueError(f"allowed_prefix {allowed_prefix!r} must start with {SEGMENT_PREFIX!r}")
        self.allowed_prefix = allowed_prefix
        self._lock = threading.Lock()
        self._segments: dict[str, ShmSegment] = {}

    def view(self, name: str, offset: int, nbytes: int) -> memoryview:
        """A view of ``[offset, offset+nbytes)`` of segment ``name``; ValueError/OSError if refused."""
        with self._lock:
            segment = self._segments.get(name)
            if segment is None:
                check_segment_name(name)
                if not name.startswith(self.allowed_prefix):
                    raise ValueError(f"shared-memory segment {name!r} is not one of this pipeline's "
                                     f"(expected prefix {self.allowed_prefix!r})")
                segment = ShmSegment.attach(name)
                self._segments[name] = segment
                SEGMENT_INDEX.add(segment)
        return segment.view(offset, nbytes)

    def detach(self, names: list[str] | None = None, prefix: str | None = None) -> None:
        with self._lock:
            chosen = [
                n for n in self._segments
                if (names is not None and n in names) or (prefix is not None and has_prefix(n, prefix))
            ] if (names is not None or prefix is not None) else list(self._segments)
            for name in chosen:
                segment = self._segments.pop(name)
                SEGMENT_INDEX.remove(segment)
                segment.close()

    def __len__(self) -> int:
        return len(self._segments)

    def names(self) -> list[str]:
        """Names of the segments mapped here."""
        return list(self._segments)

    def segment(self, name: str) -> ShmSegment | None:
        """This process's mapping of segment ``name`` (None: not attached)."""
        return self._segments.get(name)


_DEFAULT_ATTACHMENTS: ShmAttachments | None = None


def default_attachments() -> ShmAttachments:
    """The process-wide attachment cache: a segment is mapped once per process."""
    global _DEFAULT_ATTACHMENTS
    if _DEFAULT_ATTACHMENTS is None:
        _DEFAULT_ATTACHMENTS = ShmAttachments(process_prefix())
    return _DEFAULT_ATTACHMENTS


def list_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def has_prefix(name: str, prefix: str) -> bool:
    """Whether segment ``name`` is ``prefix`` or under it (``<prefix>_...``).

    Whole ``_``-separated components only: stage 1's prefix ``..._s1`` must
    not match stage 10's segments ``..._s10_0``.
    """
    return name == prefix or name.startswith(prefix + "_")


def unlink_prefix(prefix: str) -> list[str]:
    """Unlink every segment named ``prefix`` or ``<prefix>_...`` (a dead stage's)."""
    removed = []
    for name in list_segments(prefix):
        if not has_prefix(name, prefix):
            continue
        try:
            os.unlink(SHM_DIR / name)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments() -> list[str]:
    """Unlink segments left by runs whose client process no longer exists."""
    removed = []
    for name in list_segments():
        match = _RUN_RE.match(name)
        if match and not pid_alive(int(match.group(1))):
            removed.extend(unlink_prefix(name))
    if removed:
        logger.info("removed %d stale shared-memory segments of dead runs", len(removed))
    return removed
