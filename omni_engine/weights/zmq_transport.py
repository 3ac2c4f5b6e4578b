"""The ``zmq`` weight backend's data plane: a sender serves chunks, stages fetch them.

The sender binds a ROUTER and answers ``[push_id, chunk]`` with one frame per
tensor, sent zero-copy from the trainer's own tensors; only the chunk being pushed
is offered, so the trainer never holds more than one chunk for the transfer. With
CURVE, the sender's authenticator admits only the client key it handed out in its
``init_info`` (which travels over the engine's authenticated control routes), so
a stranger who learns the address still gets nothing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from omni_engine.stage_engine.security import (
    CurveKeys,
    KeyPair,
    StageCurveKeys,
    make_client,
    make_server,
    start_authenticator,
)

logger = logging.getLogger(__name__)

_OK = b"ok"
_ERR = b"err"


class ChunkServer:
    """Serves the chunk being pushed to whoever of the stages asks (a thread of the sender's)."""

    def __init__(self, bind: str = "tcp://127.0.0.1:0", curve: bool = True) -> None:
        self._ctx = zmq.Context()
        self.keys = CurveKeys.generate() if curve else None
        self._auth: ThreadAuthenticator | None = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        if self.keys is not None:
            self._auth = start_authenticator(self._ctx, self.keys)
            make_server(self._sock, self.keys)
        self._sock.bind(bind)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wake_recv = self._ctx.socket(zmq.PAIR)
        self._wake_send = self._ctx.socket(zmq.PAIR)
        wake = f"inproc://omni-weights-wake-{id(self)}"
        self._wake_recv.bind(wake)
        self._wake_send.connect(wake)
        self._lock = threading.Lock()
        self._offered: tuple[str, int, list[Any]] | None = None
        self.fetches = 0
        self._thread = threading.Thread(target=self._serve, name="omni-weight-sender", daemon=True)
        self._thread.start()

    def init_info(self, timeout_s: float) -> dict[str, Any]:
        info: dict[str, Any] = {"address": self.address, "timeout_s": timeout_s}
        if self.keys is not None:
            assert self.keys.client is not None
            info["server_public_key"] = self.keys.server.public.decode()
            info["client_public_key"] = self.keys.client.public.decode()
            info["client_secret_key"] = self.keys.client.secret.decode()
        return info

    def offer(self, push_id: str, chunk: int, buffers: list[Any]) -> None:
        """From now on chunk ``chunk`` of ``push_id`` is these buffers (the previous one is withdrawn)."""
        with self._lock:
            self._offered = (push_id, chunk, buffers)

    def withdraw(self) -> None:
        with self._lock:
            self._offered = None

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_recv in ready:
                return
            frames = self._sock.recv_multipart()
            self._answer(frames)

    def _answer(self, frames: list[bytes]) -> None:
        identity = frames[0]
        try:
            push_id, chunk = frames[1].decode(), int(frames[2])
        except (IndexError, UnicodeDecodeError, ValueError):
            self._sock.send_multipart([identity, _ERR, b"malformed chunk request"])
            return
        with self._lock:
            offered = self._offered
        if offered is None or offered[:2] != (push_id, chunk):
            now = f"chunk {offered[1]} of push {offered[0]!r}" if offered else "nothing"
            self._sock.send_multipart([identity, _ERR, f"chunk {chunk} of push {push_id!r} is not offered (the "
                                                        f"sender offers {now})".encode()])
            return
        self.fetches += 1
        self._sock.send_multipart([identity, _OK, *offered[2]], copy=False)

    def close(self) -> None:
        if self._thread.is_alive():
            self._wake_send.send(b"")
            self._thread.join(5)
        for sock in (self._sock, self._wake_recv, self._wake_send):
            sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


class ChunkFetcher:
    """A stage's side: asks the sender for a chunk and waits (bounded) for its frames."""

    def __init__(self, address: str, server_public_key: str | None, timeout_s: float,
                 client_public_key: str | None = None, client_secret_key: str | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._curve = None
        if server_public_key is not None:
            if not client_public_key or not client_secret_key:
                raise ValueError("init_weight_transfer_engine: a zmq init_info with server_public_key needs the "
                                 "client_public_key and client_secret_key the sender made")
            self._curve = StageCurveKeys(KeyPair(client_public_key.encode(), client_secret_key.encode()),
                                         server_public_key.encode())
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            if self._curve is not None:
                make_client(sock, self._curve)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def fetch(self, push_id: str, chunk: int) -> list[memoryview]:
        sock = self._socket()
        sock.send_multipart([push_id.encode(), str(chunk).encode()])
        if not sock.poll(int(self.timeout_s * 1000)):
            # A reply still on its way would answer the next request: start over with a new socket.
            sock.close(0)
            self._sock = None
            raise ValueError(f"update_weights: the weight sender at {self.address} did not send chunk {chunk} of "
                             f"push {push_id!r} within {self.timeout_s:g} s (did it exit?); nothing was loaded")
        reply = sock.recv_multipart(copy=False)
        if reply[0].bytes != _OK:
            message = reply[1].bytes.decode(errors="replace") if len(reply) > 1 else "no reason given"
            raise ValueError(f"update_weights: the weight sender at {self.address} refused: {message}")
        return [frame.buffer for frame in reply[1:]]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._ctx.term()
