"""``VersionedReadyQueue``: one rank's packs, each tagged with the weight version that made it.

The prefetch thread puts, the training loop pops. Freshness is decided when a pack
is looked at, against the learner's current version: a pack with
``ver < current_ver - version_window`` is dropped (counted) and never consumed.
``queue_limit`` bounds memory: a put beyond it drops the oldest pack (counted),
since the oldest is the first to go stale anyway.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Versioned(Generic[T]):
    item: T
    ver: int


@dataclass
class QueueCounters:
    stale_drops: int = 0
    limit_drops: int = 0
    puts: int = 0
    pops: int = 0
    lags: list[int] = field(default_factory=list)  # current_ver - ver of each consumed pack


class VersionedReadyQueue(Generic[T]):
    """Thread-safe FIFO of versioned packs with a freshness window and a size limit."""

    def __init__(self, version_window: int, queue_limit: int) -> None:
        if version_window < 0:
            raise ValueError(f"version_window must be >= 0, got {version_window}")
        if queue_limit < 1:
            raise ValueError(f"queue_limit must be >= 1, got {queue_limit}")
        self.version_window = version_window
        self.queue_limit = queue_limit
        self.counters = QueueCounters()
        self._items: deque[Versioned[T]] = deque()
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # a producer waits here while the queue is full
        self._closed = False

    def put(self, item: T, ver: int) -> None:
        with self._lock:
            if self._closed:
                return
            self._items.append(Versioned(item, ver))
            self.counters.puts += 1
            while len(self._items) > self.queue_limit:
                self._items.popleft()
                self.counters.limit_drops += 1

    def _drop_stale(self, current_ver: int) -> None:
        oldest_fresh = current_ver - self.version_window
        kept = [v for v in self._items if v.ver >= oldest_fresh]
        if len(kept) < len(self._items):
            self.counters.stale_drops += len(self._items) - len(kept)
            self._items = deque(kept)
            self._room.notify_all()

    def ready(self, current_ver: int) -> int:
        """Packs a consumer at ``current_ver`` may take (stale ones are dropped first)."""
        with self._lock:
            self._drop_stale(current_ver)
            return len(self._items)

    def pop(self, current_ver: int) -> Versioned[T] | None:
        """The oldest fresh pack, or None when there is none (never blocks: the gate decided already)."""
        with self._lock:
            self._drop_stale(current_ver)
            if not self._items:
                return None
            taken = self._items.popleft()
            self._room.notify_all()
            self.counters.pops += 1
            self.counters.lags.append(current_ver - taken.ver)
            return taken

    def advance(self, current_ver: int) -> None:
        """The learner moved to ``current_ver``: drop what went stale now, making room for fresh packs."""
        with self._lock:
            self._drop_stale(current_ver)

    def wait_for_room(self, room: int = 1, timeout: float | None = None) -> bool:
        """Block the producer until ``room`` more packs fit (rolling out packs only to drop them wastes
        the server's time); False if there is still no room after ``timeout``, or the queue closed."""
        room = min(max(room, 1), self.queue_limit)
        with self._room:
            return self._room.wait_for(lambda: self._closed or len(self._items) + room <= self.queue_limit,
                                       timeout) and not self._closed

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def close(self) -> None:
        """Drop everything and refuse later puts (the learner is done)."""
        with self._lock:
            self._closed = True
            self._items.clear()
            self._room.notify_all()
