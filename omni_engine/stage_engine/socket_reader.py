"""``SocketReader``: every message waiting on a ZMQ socket, read in one event-loop callback.

pyzmq's asyncio ``recv_multipart`` costs a future, a loop turn to wake the
awaiting task and the bookkeeping of its poller for each message; a reader
task that handles one message per await pays all of it again for the next
one that is already there. Here the loop watches the socket's file descriptor
and one callback reads with ``NOBLOCK`` until the socket is empty, handing
each message to ``on_frames`` as it comes.

ZMQ's descriptor is edge-triggered: it fires when the socket's state changes,
and anything else that touches the socket (a send on it, reading
``zmq.EVENTS``) may consume that edge. So the socket must not also be used
through pyzmq's asyncio API (one reader per descriptor), and whoever touches it
otherwise calls ``check()`` afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq

# Messages read per callback before the loop gets a turn (then the rest, on the next).
MAX_MESSAGES_PER_TURN = 256


class SocketReader:
    """Hands every message arriving on ``sock`` to ``on_frames`` (on ``loop``, in order).

    An exception from ``on_frames`` or the socket stops the reader and goes to
    ``on_error``: a reader that died silently would leave every waiter hanging.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket,
                 on_frames: Callable[[list[zmq.Frame]], object],
                 on_error: Callable[[BaseException], object], copy: bool = False) -> None:
        # A plain socket on the same libzmq socket: its recv never involves pyzmq's asyncio poller.
        self._sock = zmq.Socket.shadow(sock.underlying)
        self._loop = loop
        self._on_frames = on_frames
        self._on_error = on_error
        self._copy = copy
        self._fd: int | None = self._sock.getsockopt(zmq.FD)
        self._scheduled = False
        loop.add_reader(self._fd, self._drain)
        self.check()  # what arrived before the descriptor was watched fired no edge we saw

    @property
    def closed(self) -> bool:
        return self._fd is None

    def check(self) -> None:
        """After anything else touched the socket: read on if a message is waiting."""
        if self._fd is not None and not self._scheduled and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        recv, flags, copy = self._sock.recv_multipart, zmq.NOBLOCK, self._copy
        try:
            for _ in range(MAX_MESSAGES_PER_TURN):
                if self._fd is None:
                    return
                try:
                    frames = recv(flags, copy=copy)
                except zmq.Again:
                    # Empty; also how a read that only consumed a CURVE credential message ends.
                    return
                self._on_frames(frames)
            self.check()  # more waiting: the rest on the next turn, after the loop's other work
        except Exception as exc:  # noqa: BLE001 - handed on, see the class docstring
            self.close()
            self._on_error(exc)

    def close(self) -> None:
        """Stop watching (before the socket closes: a later socket may reuse the descriptor
        number, and a stale watcher would never wake for it). Idempotent."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self._loop.remove_reader(fd)
