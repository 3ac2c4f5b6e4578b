"""The stage process: one ``StageEngine`` behind ZMQ (vLLM's ``EngineCoreProc`` pattern).

Three threads so that socket I/O and (de)serialization overlap with compute:

* the input thread receives and decodes requests from the DEALER socket and
  hands them to the event loop (``call_soon_threadsafe``);
* the event loop (uvloop) runs the engine: one task per request;
* the output thread encodes and sends on the PUSH socket. It blocks for the
  first item and then drains whatever else is ready, so outputs produced at
  the same time leave in one ``StageOutputs`` message.

Nothing here polls: each thread blocks on its socket or queue.
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

from omni_engine.connectors.shm import (
    ShmAttachments,
    ShmPool,
    new_run_prefix,
    owner_process_prefix,
    set_output_pool,
    stage_prefix,
)
from omni_engine.engines.base import StageEngine
from omni_engine.outputs import OmniRequestOutput
from omni_engine.stage_engine import security
from omni_engine.wire.protocol import (
    MALFORMED_MESSAGE,
    REQUEST_STRUCTS,
    REQUEST_TYPES,
    StageError,
    StageHeartbeat,
    StageOutputs,
    StageReady,
    StageRequestType,
    StageResponseType,
    decode_frames,
    guess_request_id,
)
from omni_engine.connectors.settings import DEFAULT_CONNECTORS, ConnectorSettings
from omni_engine.stage_engine.security import StageCurveKeys
from omni_engine.stage_engine.stage_core import StageEngineCore, serve_stage
from omni_engine.stage_engine.stage_spec import StageProcessSpec
from omni_engine.wire.stage_serialization import (
    StageMsgpackDecoder,
    StageMsgpackEncoder,
    WireFormatError,
)
from omni_engine.stage_engine.stage_sockets import open_stage_socket
from omni_engine.utils import call_quietly, machine_host_id

logger = logging.getLogger(__name__)

_STOP = object()
# Output-queue marker: every output of this request is encoded once the marker is reached.
_REQUEST_DONE = object()
_OUTPUT = StageResponseType.OUTPUT


class StageEngineCoreProc(StageEngineCore):
    """Serves one engine on a DEALER (requests in) and a PUSH (responses out) socket."""

    PROC_UTILITY_METHODS = StageEngineCore.PROC_UTILITY_METHODS | {"shm_stats"}

    def __init__(
        self,
        stage_id: int,
        engine: StageEngine,
        input_address: str,
        output_address: str,
        shm_prefix: str | None = None,
        curve: StageCurveKeys | None = None,
        connectors: ConnectorSettings = DEFAULT_CONNECTORS,
        ctx: zmq.Context | None = None,
        host_id: str | None = None,
        heartbeat_interval: float | None = None,
    ) -> None:
        """``ctx``: the client's context, for a stage in a thread of its process (``inproc://``
        needs one context for both ends); it is the client's to terminate. ``host_id``: what
        READY reports (default: this machine's); ``heartbeat_interval``: seconds of quiet
        after which a HEARTBEAT goes out (None: never)."""
        super().__init__(stage_id, engine, queue.SimpleQueue())
        self.host_id = host_id or machine_host_id()
        self.heartbeat_interval = heartbeat_interval
        self.curve = curve
        self.connectors = connectors
        self.input_address = input_address
        self.output_address = output_address
        self.shm_prefix = shm_prefix or stage_prefix(new_run_prefix(), stage_id)
        # use_shm false: every tensor travels as a ZMQ frame.
        self.pool = ShmPool(self.shm_prefix, connectors.shm_pool_bytes) if connectors.use_shm else None
        # Handles may name any segment of this pipeline (zero-copy forwarding
        # from another stage), and nothing else.
        self.attachments = ShmAttachments(owner_process_prefix(self.shm_prefix))
        self._own_ctx = ctx is None
        self.ctx = zmq.Context() if ctx is None else ctx
        self._wake_address = f"inproc://stage-input-wake-{id(self)}"
        self._wake: zmq.Socket | None = None
        self._threads: list[threading.Thread] = []

    def _start_transport(self) -> None:
        set_output_pool(self.pool, self.connectors.shm_threshold)  # models may write large outputs straight into it (empty_output)
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

    def _on_request_done(self, request_id: str) -> None:
        if self.pool is not None:
            self._out_q.put((_REQUEST_DONE, request_id))

    def shm_stats(self) -> dict[str, int]:
        """The stage's shared-memory pool: segments held, leased, bytes."""
        if self.pool is None:
            return {"leased": 0, "bytes": 0}
        return {"leased": self.pool.num_leased(), "bytes": self.pool.total_bytes}

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
            self._serve_input(sock, wake)
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

    def _serve_input(self, sock: zmq.Socket, wake: zmq.Socket) -> None:
        """Receive, decode and dispatch requests until woken to stop."""
        decoders = {t: StageMsgpackDecoder(cls, shm=self.attachments, allow_pickle=self.connectors.allow_pickle)
                    for t, cls in REQUEST_STRUCTS.items()}
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if wake in events:
                return
            self._handle_frames(sock.recv_multipart(copy=False), decoders)

    def _handle_frames(self, frames: list[zmq.Frame], decoders: dict) -> None:
        """Decode one request and hand it to the loop.

        A malformed one is dropped with a warning and answered with ERROR
        (naming its request when the id can be read), never fatal: the next
        valid request is served as usual.
        """
        try:
            req_type, msg = decode_frames(frames, REQUEST_TYPES, decoders)
        except WireFormatError as exc:
            request_id = guess_request_id(frames)
            where = f"stage {self.stage_id}: malformed request message" + (
                f" for request {request_id!r:.100}" if request_id is not None else "")
            logger.warning("%s dropped: %s", where, exc)
            self._send_error(f"{where}: {exc}", request_id, MALFORMED_MESSAGE)
            return
        if req_type is StageRequestType.RELEASE:
            if self.pool is not None:
                self.pool.release(msg.segments)  # names not leased (any more) are ignored
            return
        self._dispatch_threadsafe(req_type, msg)

    # --------------------------------------------------------- output side
    def _output_thread(self) -> None:
        sock = open_stage_socket(self.ctx, zmq.PUSH, self.output_address, self.curve)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(self.output_address)
        encoder = StageMsgpackEncoder.from_settings(self.connectors, self.pool)
        get, get_nowait = self._out_q.get, self._out_q.get_nowait
        interval = self.heartbeat_interval
        try:
            while True:
                try:
                    items = [get(timeout=interval)]
                except queue.Empty:  # quiet for a whole interval: say we are still here
                    self._send(sock, encoder, StageResponseType.HEARTBEAT, StageHeartbeat(time.time()))
                    continue
                try:
                    while True:
                        items.append(get_nowait())
                except queue.Empty:
                    pass
                if not self._send_items(sock, encoder, items):
                    return
        finally:
            sock.close()

    def _send_items(self, sock: zmq.Socket, encoder: StageMsgpackEncoder, items: list[Any]) -> bool:
        """Send ``items`` in order, consecutive outputs as one message. False on stop."""
        outputs: list[OmniRequestOutput] = []
        for item in items:
            if item is _STOP:
                self._send_outputs(sock, encoder, outputs)
                return False
            rtype, payload = item
            if rtype is _OUTPUT:
                outputs.append(payload)
                continue
            if rtype is _REQUEST_DONE:
                # Its outputs must be encoded before unsent output slots go back.
                self._send_outputs(sock, encoder, outputs)
                outputs = []
                self.pool.release_unsent(payload)
                continue
            self._send_outputs(sock, encoder, outputs)
            outputs = []
            self._send(sock, encoder, rtype, payload)
        self._send_outputs(sock, encoder, outputs)
        return True

    def _send_outputs(self, sock: zmq.Socket, encoder: StageMsgpackEncoder, outputs: list[Any]) -> None:
        if not outputs:
            return
        try:
            self._send(sock, encoder, _OUTPUT, StageOutputs(outputs, time.time()), strict=True)
        except TypeError:
            # One output the wire cannot carry must not take the others down.
            for output in outputs:
                try:
                    self._send(sock, encoder, _OUTPUT, StageOutputs([output], time.time()), strict=True)
                except TypeError as exc:
                    self._send(sock, encoder, StageResponseType.ERROR, StageError(
                        f"stage {self.stage_id}: output of request {output.request_id!r} cannot be sent: {exc}",
                        output.request_id, "TypeError"))

    def _send(self, sock: zmq.Socket, encoder: StageMsgpackEncoder, rtype: StageResponseType, payload: Any,
              strict: bool = False) -> None:
        try:
            bufs = encoder.encode(payload)
        except TypeError:
            if strict:
                raise
            logger.exception("stage %d: cannot encode %s message", self.stage_id, rtype.name)
            return
        sock.send_multipart([rtype.value, *bufs], copy=False)


def serve_zmq_stage(spec: StageProcessSpec) -> None:
    """A ZMQ stage process's serving function (after ``stage_entry`` set the process up)."""
    from omni_engine.engines import build_stage_engine

    transport = spec.transport
    if transport is None:
        raise ValueError(f"stage {spec.stage_id}: a ZMQ stage process needs spec.transport (its addresses)")

    def make_core() -> StageEngineCoreProc:
        engine = build_stage_engine(spec)
        return StageEngineCoreProc(spec.stage_id, engine, transport.input_address, transport.output_address,
                                   transport.shm_prefix, spec.curve, spec.connectors, host_id=spec.host_id,
                                   heartbeat_interval=spec.heartbeat_interval)

    serve_stage(spec.stage_id, make_core)
