"""``ThreadedStageEngineCoreProc``: the ZMQ stage with socket I/O in threads (``runtime.io: threads``).

vLLM's ``EngineCoreProc`` shape: an input thread receives and decodes requests
and hands them to the event loop (``call_soon_threadsafe``); the loop runs the
engine; an output thread encodes and sends, blocking for the first answer and
then draining whatever else is ready, so answers produced at the same time
leave in one message. For a model that computes on its event loop: decoding,
encoding and sending then overlap its steps on another core. Each message pays
a hand-off between threads (a wake-up and a GIL hand-over), which is why the
loop-I/O ``StageEngineCoreProc`` is the default.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

import msgspec
import zmq

from omni_engine.connectors.shm import set_output_pool
from omni_engine.stage_engine import security
from omni_engine.stage_engine.stage_core import ResponseSink
from omni_engine.stage_engine.stage_core_proc import OUTPUT_LINGER_S, StageEngineCoreProc
from omni_engine.stage_engine.stage_sockets import open_stage_socket
from omni_engine.utils import call_quietly
from omni_engine.wire.protocol import StageHeartbeat, StageReady, StageRequestType, StageResponseType

logger = logging.getLogger(__name__)

_STOP = object()


class ThreadedStageEngineCoreProc(StageEngineCoreProc):
    """``StageEngineCoreProc`` with an input and an output thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._wake_address = f"inproc://stage-input-wake-{id(self)}"
        self._wake: zmq.Socket | None = None
        self._threads: list[threading.Thread] = []

    def _new_response_sink(self) -> ResponseSink:
        return queue.SimpleQueue()

    def _start_transport(self) -> None:
        set_output_pool(self.pool, self.connectors.shm_threshold)
        self._wake = self.ctx.socket(zmq.PAIR)
        self._wake.bind(self._wake_address)
        self._threads = [
            threading.Thread(target=self._output_thread, name="stage-output", daemon=True),
            threading.Thread(target=self._input_thread, name="stage-input", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    async def _stop_transport(self) -> None:
        self._out_q.put(_STOP)
        if self._wake is not None:
            try:
                # Non-blocking: an input thread that already ended (handshake
                # failed) has closed its end, and a PAIR send without a peer blocks.
                self._wake.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass
        for thread in self._threads:
            thread.join(timeout=10)
        if self._wake is not None:
            self._wake.close(linger=0)
        set_output_pool(None)
        if self.pool is not None:
            call_quietly(self.pool.close, "unlinking shared memory")
        call_quietly(lambda: self.attachments.detach(), "detaching shared memory")
        if self._own_ctx:
            self.ctx.term()

    def _deliver(self, req_type: StageRequestType, msg: Any) -> None:
        self._dispatch_threadsafe(req_type, msg)

    # ---------------------------------------------------------- input side
    def _input_thread(self) -> None:
        sock = open_stage_socket(self.ctx, zmq.DEALER, self.input_address, self.curve)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = security.watch_handshake(sock) if self.curve is not None else None
        sock.connect(self.input_address)
        wake = self.ctx.socket(zmq.PAIR)
        wake.connect(self._wake_address)
        try:
            if monitor is not None:
                # A key the client refuses fails here, clearly, not as a startup timeout.
                security.wait_for_handshake(sock, monitor, wake, self.input_address)
            ready = StageReady(self.stage_id, os.getpid(), self.shm_prefix, self.engine.info(), self.host_id)
            sock.send_multipart([StageResponseType.READY.value, msgspec.msgpack.encode(ready)])
            self._serve_input_thread(sock, wake)
        except zmq.ContextTerminated:
            return
        except security.CurveHandshakeError as exc:
            self._call_threadsafe(self._fatal, exc, False)
        except Exception as exc:  # noqa: BLE001 - a bug here leaves the stage deaf: report it as fatal
            logger.exception("stage %d: input thread failed", self.stage_id)
            self._call_threadsafe(self._fatal, exc)
        finally:
            sock.close(linger=0)
            wake.close(linger=0)

    def _serve_input_thread(self, sock: zmq.Socket, wake: zmq.Socket) -> None:
        """Receive, decode and dispatch requests until woken to stop."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if wake in events:
                return
            self._handle_frames(sock.recv_multipart(copy=False))

    # --------------------------------------------------------- output side
    def _output_thread(self) -> None:
        sock = open_stage_socket(self.ctx, zmq.PUSH, self.output_address, self.curve)
        sock.setsockopt(zmq.LINGER, int(OUTPUT_LINGER_S * 1000))
        sock.connect(self.output_address)
        get, get_nowait = self._out_q.get, self._out_q.get_nowait
        interval = self.heartbeat_interval
        try:
            while True:
                try:
                    items = [get(timeout=interval)]
                except queue.Empty:  # quiet for a whole interval: say we are still here
                    self._send(sock, StageResponseType.HEARTBEAT, StageHeartbeat(time.time()))
                    continue
                try:
                    while True:
                        items.append(get_nowait())
                except queue.Empty:
                    pass
                stop = next((n for n, item in enumerate(items) if item is _STOP), None)
                self._send_items(sock, items[:stop])
                if stop is not None:
                    return
        finally:
            sock.close()
