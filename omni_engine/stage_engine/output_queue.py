"""``StageOutputQueue``: a stage's output batches that no reader has taken yet.

A deque, not an ``asyncio.Queue``, so that an abort can drop what is queued
for the aborted requests: their outputs may hold shared-memory slots. Shared
by a stage client and a replica set (which merges its replicas' batches).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any


class StageOutputQueue:
    """Batches in arrival order; readers wait on an event, never poll."""

    def __init__(self) -> None:
        self._batches: deque[list[Any]] = deque()
        self._ready = asyncio.Event()
        self._pending: list[Any] = []  # the rest of a batch ``get_one`` started

    def put(self, items: list[Any]) -> None:
        self._batches.append(items)
        self._ready.set()

    def wake(self) -> None:
        """Wake the readers (to look at ``dead`` once the queue is drained)."""
        self._ready.set()

    async def get_batch(self, dead: Callable[[], BaseException | None]) -> list[Any]:
        """The next batch; raises ``dead()`` once it is not None and the queue is drained."""
        while not self._batches:
            error = dead()
            if error is not None:
                raise error
            self._ready.clear()
            await self._ready.wait()
        return self._batches.popleft()

    async def get_one(self, dead: Callable[[], BaseException | None]) -> Any:
        """The next item of any batch; an item that is an exception (a request's error) is raised."""
        while not self._pending:
            self._pending = await self.get_batch(dead)
            self._pending.reverse()
        item = self._pending.pop()
        if isinstance(item, BaseException):
            raise item
        return item

    def drop(self, request_ids: set[str]) -> None:
        """Forget queued items of ``request_ids`` (aborted: nobody will read them)."""
        kept: deque[list[Any]] = deque()
        for batch in self._batches:
            batch = [item for item in batch if item.request_id not in request_ids]
            if batch:
                kept.append(batch)
        self._batches = kept
        self._pending = [item for item in self._pending if item.request_id not in request_ids]

    def __len__(self) -> int:
        """Items queued."""
        return sum(len(batch) for batch in self._batches) + len(self._pending)
