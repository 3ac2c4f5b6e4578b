"""``LoopSocket``: a ZMQ socket driven by the event loop's watch of its descriptor.

pyzmq's asyncio sockets cost a future, a loop turn to wake the awaiting task
and the bookkeeping of a poller for every message, each way; a reader task
that handles one message per await pays all of it again for the next one that
is already there. Here the loop watches the socket's file descriptor and one
callback reads with ``NOBLOCK`` until the socket is empty, handing each message
to ``on_frames`` as it comes; a send is a ``NOBLOCK`` send, and only what the
socket cannot take now (its high-water mark reached: the peer stopped reading)
waits, in order, for the descriptor to say there is room.

ZMQ's descriptor is edge-triggered: it fires when the socket's state changes,
and anything else that touches the socket (a send on it, reading
``zmq.EVENTS``) may consume that edge. So the socket must not also be used
through pyzmq's asyncio API (one watcher per descriptor), and a socket read
here whose sends may take an edge that matters calls ``check()`` after them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

# Messages read per callback before the loop gets a turn (then the rest, on the next).
MAX_MESSAGES_PER_TURN = 256


class LoopSocket:
    """Hands every message arriving on ``sock`` to ``on_frames`` (on ``loop``, in order), and
    sends without blocking the loop. ``on_frames`` None: the socket only sends.

    An exception from ``on_frames`` or the socket stops it and goes to ``on_error``:
    a reader that died silently would leave every waiter hanging.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket,
                 on_frames: Callable[[list[Any]], object] | None,
                 on_error: Callable[[BaseException], object], copy: bool = False) -> None:
        # A plain socket on the same libzmq socket: nothing of pyzmq's asyncio poller is involved.
        self._sock = zmq.Socket.shadow(sock.underlying)
        self._loop = loop
        self._on_frames = on_frames
        self._on_error = on_error
        self._copy = copy
        self._fd: int | None = self._sock.getsockopt(zmq.FD)
        self._scheduled = False
        # Messages the socket could not take yet, oldest first, and who waits for them to go.
        self._backlog: deque[tuple[list[Any], bool]] = deque()
        self._flushed: list[asyncio.Future] = []
        if on_frames is not None:
            loop.add_reader(self._fd, self._on_events)
            self.check()  # what arrived before the descriptor was watched fired no edge we saw

    @property
    def closed(self) -> bool:
        return self._fd is None

    @property
    def backlog(self) -> int:
        """Messages waiting for room in the socket."""
        return len(self._backlog)

    def check(self) -> None:
        """After anything else touched the socket: read on if a message is waiting."""
        if self._fd is not None and not self._scheduled and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._schedule()

    # ---------------------------------------------------------------- send
    def send_multipart(self, frames: list[Any], copy: bool = False) -> bool:
        """Send now if the socket takes it (True), else keep it, in order, until it can (False).

        Errors other than a full socket (a ROUTER's unreachable peer) are raised here.
        """
        if self._fd is None:
            raise zmq.ZMQError(zmq.ENOTSOCK, "the socket is closed")
        if not self._backlog:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
                return True
            except zmq.Again:
                pass
        self._backlog.append((frames, copy))
        if len(self._backlog) == 1:
            if self._on_frames is None:
                self._loop.add_reader(self._fd, self._on_events)
            self._schedule()  # the failed send may have taken the edge that says there is room
        return False

    async def flushed(self) -> None:
        """Return once every message kept for later is sent (at once if none is)."""
        if self._backlog and self._fd is not None:
            future = self._loop.create_future()
            self._flushed.append(future)
            await future

    def _send_backlog(self) -> None:
        send = self._sock.send_multipart
        while self._backlog:
            frames, copy = self._backlog[0]
            try:
                send(frames, zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return  # still full: the descriptor fires when that changes
            self._backlog.popleft()
        if self._on_frames is None:
            self._loop.remove_reader(self._fd)
        self._wake_flushed()

    def _wake_flushed(self) -> None:
        waiters, self._flushed = self._flushed, []
        for future in waiters:
            if not future.done():
                future.set_result(None)

    # ---------------------------------------------------------------- read
    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._on_events)

    def _on_events(self) -> None:
        self._scheduled = False
        try:
            if self._backlog:
                self._send_backlog()
            if self._on_frames is not None:
                self._read()
        except Exception as exc:  # noqa: BLE001 - handed on, see the class docstring
            self.close()
            self._on_error(exc)

    def _read(self) -> None:
        recv, flags, copy, events = self._sock.recv_multipart, zmq.NOBLOCK, self._copy, self._sock.getsockopt
        on_frames = self._on_frames
        for _ in range(MAX_MESSAGES_PER_TURN):
            if self._fd is None:
                return
            try:
                frames = recv(flags, copy=copy)
            except zmq.Again:
                # Empty; also how a read that only consumed a CURVE credential message ends.
                return
            on_frames(frames)
            # Reading EVENTS re-arms the descriptor: cheaper than the failing recv (and the
            # exception pyzmq builds for it) that would otherwise end every drain.
            if self._fd is None or not events(zmq.EVENTS) & zmq.POLLIN:
                return
        self._schedule()  # more waiting: the rest on the next turn, after the loop's other work

    def close(self) -> None:
        """Stop watching (before the socket closes: a later socket may reuse the descriptor
        number, and a stale watcher would never wake for it). What was kept unsent is dropped
        (the socket's own linger still covers what it took). Idempotent."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self._loop.remove_reader(fd)
            self._backlog.clear()
            self._wake_flushed()
