"""Consumer-side bookkeeping of shared-memory slots: when may a producer reuse one?

A slot leased by a stage for a request's tensor may be recycled only when
(1) nobody in this process still holds a view of it, and (2) the request has
ended, since until then the handle may still be forwarded to another stage.
Views are tracked with ``weakref.finalize`` on the memoryview every decoded
tensor is built on (numpy and torch views keep it alive), so a caller that
keeps an output's tensor keeps its slot; one that drops it frees it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable

from omni_engine.connectors.shm import has_prefix

logger = logging.getLogger(__name__)

ReleaseFn = Callable[[list[str]], None]

# Request ids remembered as ended (outputs of aborted requests may still be
# in flight); bounded so that a long-running client does not grow.
_MAX_ENDED = 65536


class ShmLeaseBook:
    """Tracks live views per segment and releases slots back to their producer.

    Producers register a segment-name prefix and a release function; releases
    are batched and sent from the event loop (finalizers fire on any thread).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._views: dict[str, int] = defaultdict(int)
        self._owner: dict[str, str | None] = {}
        # Read without the lock by the client, which only asks whether a request has slots
        # or ended before (a dict lookup is atomic); written under it.
        self.slots_by_request: dict[str, set[str]] = defaultdict(set)
        self.ended: OrderedDict[str, None] = OrderedDict()
        self._producers: dict[str, ReleaseFn] = {}
        self._to_release: list[str] = []
        self._flush_scheduled = False

    def add_producer(self, prefix: str, release: ReleaseFn) -> None:
        self._producers[prefix] = release

    def remove_producer(self, prefix: str) -> None:
        """Forget a (dead or stopped) producer's segments: they are unlinked by prefix."""
        with self._lock:
            self._producers.pop(prefix, None)
            for name in [n for n in self._owner if has_prefix(n, prefix)]:
                self._forget_locked(name)
            self._to_release = [n for n in self._to_release if not has_prefix(n, prefix)]

    def on_view(self, name: str, owner: str | None, view: object) -> None:
        """Called by the decoder for every shared-memory view it hands out.

        ``view`` must be an object every decoded value keeps alive (the
        decoder passes the uint8 array its tensors/arrays are built on).
        """
        with self._lock:
            self._views[name] += 1
            self._owner[name] = owner
            if owner is not None:
                self.slots_by_request[owner].add(name)
        weakref.finalize(view, self._view_dead, name)

    def _view_dead(self, name: str) -> None:
        with self._lock:
            if name not in self._owner:
                return
            self._views[name] -= 1
            owner = self._owner[name]
            if self._views[name] <= 0 and (owner is None or owner in self.ended):
                self._release_locked(name)

    def begin_request(self, request_id: str) -> None:
        """``request_id`` is in use (again): its slots wait for its end anew.

        Ids may be reused once a request has ended; without this a new request
        under an ended id would give its slots back while still in flight.
        """
        with self._lock:
            self.ended.pop(request_id, None)

    def end_request(self, request_id: str) -> None:
        """The request is over everywhere: slots without live views go back."""
        with self._lock:
            self.ended[request_id] = None
            if len(self.ended) > _MAX_ENDED:
                self.ended.popitem(last=False)
            for name in list(self.slots_by_request.get(request_id, ())):
                if self._views.get(name, 0) <= 0:
                    self._release_locked(name)

    def _forget_locked(self, name: str) -> None:
        owner = self._owner.pop(name, None)
        self._views.pop(name, None)
        if owner is not None:
            names = self.slots_by_request.get(owner)
            if names is not None:
                names.discard(name)
                if not names:
                    del self.slots_by_request[owner]

    def _release_locked(self, name: str) -> None:
        self._forget_locked(name)
        self._to_release.append(name)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # loop closed: the producer is going away too
                self._flush_scheduled = False

    def _flush(self) -> None:
        with self._lock:
            names, self._to_release = self._to_release, []
            self._flush_scheduled = False
        by_producer: dict[str, list[str]] = defaultdict(list)
        for name in names:
            prefix = next((p for p in self._producers if name.startswith(p + "_")), None)
            if prefix is not None:
                by_producer[prefix].append(name)
        for prefix, group in by_producer.items():
            try:
                self._producers[prefix](group)
            except Exception:  # noqa: BLE001 - a stopped producer cleans up itself
                logger.debug("release of %d segments to %s failed", len(group), prefix, exc_info=True)

    def num_tracked(self) -> int:
        return len(self._owner)


_BOOKS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ShmLeaseBook]" = weakref.WeakKeyDictionary()


def lease_book_for(loop: asyncio.AbstractEventLoop) -> ShmLeaseBook:
    """The lease book shared by every stage client on ``loop``.

    Shared, because a handle produced by one stage may come back through
    another stage's output (zero-copy forwarding): whichever client decodes
    it must be able to release it to its producer.
    """
    book = _BOOKS.get(loop)
    if book is None:
        book = _BOOKS[loop] = ShmLeaseBook(loop)
    return book
