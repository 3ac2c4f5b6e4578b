"""``StageEngineCoreProc``: a stage served over ZMQ (vLLM's ``EngineCoreProc`` pattern).

Requests come in on a DEALER socket, answers leave on a PUSH socket. Both are
read and written on the stage's event loop (uvloop), the loop that runs the
engine: the descriptor of each socket is watched by the loop (``LoopSocket``),
every request waiting is decoded and dispatched in one callback, and the
answers put during one loop turn leave together at its end, consecutive
outputs as one ``StageOutputs`` message (``LoopOutbox``).

vLLM's ``EngineCoreProc`` has an input and an output thread because its
engine step is long and runs on the thread that would otherwise read the
sockets. A stage's engine does not compute on its loop (vLLM's AsyncLLM steps
in its own EngineCore process, the generation models in worker threads), so
here the threads bought only hand-offs: each message crossed from a thread to
the loop or back, a wake-up of the other CPU and a GIL hand-over every time,
the largest cost of a short request (``benchmarks/bench_stage_ipc.py``). A
model that does compute on its loop can still have them back:
``runtime.io: threads`` (``stage_core_threads``).

Nothing here polls and nothing blocks the loop: a socket that cannot take a
message now (the client stopped reading) keeps it, in order, until it can.
Heartbeats (a stage on another host) come from a small thread of their own,
so that a loop busy for a while does not look like a lost stage.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from omni_engine.connectors.settings import DEFAULT_CONNECTORS, ConnectorSettings
from omni_engine.connectors.shm import (
    ShmAttachments,
    ShmPool,
    new_run_prefix,
    owner_process_prefix,
    set_output_pool,
    stage_prefix,
)
from omni_engine.engines.base import StageEngine
from omni_engine.stage_engine import security
from omni_engine.stage_engine.loop_socket import LoopSocket
from omni_engine.stage_engine.security import StageCurveKeys
from omni_engine.stage_engine.stage_core import TIMED_OUTPUT, ResponseSink, StageEngineCore
from omni_engine.stage_engine.stage_sockets import open_stage_socket
from omni_engine.tracing.stage_timing import StageTiming
from omni_engine.utils import call_quietly, machine_host_id
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
    split_generate_batch,
)
from omni_engine.wire.stage_serialization import (
    StageMsgpackDecoder,
    StageMsgpackEncoder,
    WireFormatError,
)

logger = logging.getLogger(__name__)

_OUTPUT = StageResponseType.OUTPUT
_GENERATE_BATCH = StageRequestType.GENERATE_BATCH.value
_GENERATE_FRAME = zmq.Frame(StageRequestType.GENERATE.value)  # the type frame a batch's parts lack
# Output-queue marker: every output of this request is encoded once the marker is reached.
REQUEST_DONE = object()
# How long a stopping stage waits for a client that stopped reading to take what is left
# (the output socket's own linger then covers what it took).
OUTPUT_LINGER_S = 2.0


class LoopOutbox:
    """The stage core's response sink on its event loop: ``put`` collects, and one flush at
    the end of the loop turn sends everything collected (``send``), in order.

    A turn that produces many items (a big batch ending) sends them in pieces of
    ``per_message``: the client decodes the first piece while this side encodes the next.
    """

    def __init__(self, send: Callable[[list[Any]], object], per_message: int = 64) -> None:
        self._send = send
        self._per_message = per_message
        self._items: list[Any] = []
        self._flush_pending = False  # an end-of-turn flush is scheduled

    def put(self, item: Any) -> None:
        self._items.append(item)
        if len(self._items) >= self._per_message:
            self.flush()
        elif not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._end_turn)

    def _end_turn(self) -> None:
        self._flush_pending = False
        self.flush()

    def flush(self) -> None:
        items, self._items = self._items, []
        if items:
            self._send(items)


class HeartbeatThread(threading.Thread):
    """Sends a HEARTBEAT every ``interval`` seconds on a PUSH socket of its own (the client's
    output socket takes it from any of the stage's connections)."""

    def __init__(self, ctx: zmq.Context, address: str, curve: StageCurveKeys | None, interval: float) -> None:
        super().__init__(name="stage-heartbeat", daemon=True)
        self._ctx, self._address, self._curve, self._interval = ctx, address, curve, interval
        self._stopping = threading.Event()

    def run(self) -> None:
        sock = open_stage_socket(self._ctx, zmq.PUSH, self._address, self._curve)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._address)
        encoder = StageMsgpackEncoder()
        try:
            while not self._stopping.wait(self._interval):
                try:
                    sock.send_multipart([StageResponseType.HEARTBEAT.value,
                                         *encoder.encode(StageHeartbeat(time.time()))], zmq.NOBLOCK)
                except zmq.Again:  # a client that reads nothing has no use for this beat
                    pass
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=5)


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
        READY reports (default: this machine's); ``heartbeat_interval``: how often a HEARTBEAT
        goes out (None: never)."""
        super().__init__(stage_id, engine, self._new_response_sink())
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
        self._decoders = {t: StageMsgpackDecoder(cls, shm=self.attachments, allow_pickle=connectors.allow_pickle,
                                                 vllm_types=engine.USES_VLLM)
                          for t, cls in REQUEST_STRUCTS.items()}
        self._encoder = StageMsgpackEncoder.from_settings(connectors, self.pool)
        self._in_sock: zmq.Socket | None = None
        self._out_sock: zmq.Socket | None = None
        self._requests_in: LoopSocket | None = None
        self._responses_out: LoopSocket | None = None
        self._handshake: tuple[zmq.Socket, LoopSocket] | None = None  # CURVE: the monitor, until it ends
        self._heartbeats: HeartbeatThread | None = None

    def _new_response_sink(self) -> ResponseSink:
        return LoopOutbox(self._send_collected)

    # ------------------------------------------------------------ transport
    def _start_transport(self) -> None:
        if self.OWNS_PROCESS:  # models may write large outputs straight into the pool (empty_output)
            set_output_pool(self.pool, self.connectors.shm_threshold)
        loop = self._loop
        self._in_sock = open_stage_socket(self.ctx, zmq.DEALER, self.input_address, self.curve)
        self._in_sock.setsockopt(zmq.LINGER, 0)
        monitor = security.watch_handshake(self._in_sock) if self.curve is not None else None
        self._in_sock.connect(self.input_address)
        self._out_sock = open_stage_socket(self.ctx, zmq.PUSH, self.output_address, self.curve)
        self._out_sock.setsockopt(zmq.LINGER, int(OUTPUT_LINGER_S * 1000))
        self._out_sock.connect(self.output_address)
        self._responses_out = LoopSocket(loop, self._out_sock, None, self._on_output_failed)
        if self.heartbeat_interval is not None:
            self._heartbeats = HeartbeatThread(self.ctx, self.output_address, self.curve, self.heartbeat_interval)
            self._heartbeats.start()
        if monitor is None:
            self._serve_input()
        else:  # READY once the client accepted our key; a refusal fails the stage, clearly
            self._handshake = monitor, LoopSocket(loop, monitor, self._on_handshake_event, self._on_input_failed,
                                                  copy=True)

    def _on_handshake_event(self, frames: list[bytes]) -> None:
        if security.handshake_ended(parse_monitor_message(frames), self.input_address):
            self._stop_handshake_watch()
            self._serve_input()

    def _stop_handshake_watch(self) -> None:
        if self._handshake is not None:
            monitor, watch = self._handshake
            self._handshake = None
            watch.close()
            security.stop_watching_handshake(self._in_sock, monitor)

    def _serve_input(self) -> None:
        """Say READY, then read requests."""
        self._requests_in = LoopSocket(self._loop, self._in_sock, self._handle_frames, self._on_input_failed)
        ready = StageReady(self.stage_id, os.getpid(), self.shm_prefix, self.engine.info(), self.host_id)
        self._requests_in.send_multipart([StageResponseType.READY.value, msgspec.msgpack.encode(ready)])

    def _on_input_failed(self, exc: BaseException) -> None:
        """A stage that cannot read is dead: say so (not to a client that refused our key:
        nothing would reach it)."""
        if not isinstance(exc, security.CurveHandshakeError):
            logger.error("stage %d: input failed", self.stage_id, exc_info=exc)
        self._fatal(exc, tell_client=not isinstance(exc, security.CurveHandshakeError))

    def _on_output_failed(self, exc: BaseException) -> None:
        logger.error("stage %d: output failed", self.stage_id, exc_info=exc)
        self._fatal(exc, tell_client=False)

    async def _stop_transport(self) -> None:
        self._out_q.flush()  # what is left (a DEAD above all)
        if self._responses_out is not None and self._responses_out.backlog:
            try:  # a client that stopped reading gets the linger's time to take the rest
                await asyncio.wait_for(self._responses_out.flushed(), OUTPUT_LINGER_S)
            except asyncio.TimeoutError:
                logger.warning("stage %d: %d message(s) not taken by the client dropped", self.stage_id,
                               self._responses_out.backlog)
        self._close_sockets(linger=None)  # (each socket's own: what is sent still reaches the client)
        if self.OWNS_PROCESS:
            set_output_pool(None)
        if self.pool is not None:
            call_quietly(self.pool.close, "unlinking shared memory")
        if self._own_ctx:
            self.ctx.term()

    def _close_sockets(self, linger: int | None = 0) -> None:
        """Close the transport without the loop (idempotent)."""
        if self._heartbeats is not None:
            self._heartbeats.stop()
            self._heartbeats = None
        self._stop_handshake_watch()
        for watch in (self._requests_in, self._responses_out):
            if watch is not None:
                try:
                    watch.close()
                except RuntimeError:  # the loop is closed: nothing watches the socket any more
                    pass
        self._requests_in = self._responses_out = None
        for sock in (self._in_sock, self._out_sock):
            if sock is not None:
                sock.close(linger=linger)
        self._in_sock = self._out_sock = None
        call_quietly(lambda: self.attachments.detach(), "detaching shared memory")

    def _on_request_done(self, request_id: str) -> None:
        if self.pool is not None:
            self._out_q.put((REQUEST_DONE, request_id))

    def _on_traced(self, request_id: str, timing: StageTiming) -> None:
        if self.pool is not None:  # (no pool, no shared memory to count; REQUEST_DONE ends the count)
            self._encoder.shm_meter[request_id] = timing

    def shm_stats(self) -> dict[str, int]:
        """The stage's shared-memory pool: segments held, leased, bytes."""
        if self.pool is None:
            return {"leased": 0, "bytes": 0}
        return {"leased": self.pool.num_leased(), "bytes": self.pool.total_bytes}

    # ---------------------------------------------------------- input side
    def _handle_frames(self, frames: list[zmq.Frame]) -> None:
        """Decode one request message and dispatch what it carries.

        A malformed request is dropped with a warning and answered with ERROR
        (naming its request when the id can be read), never fatal: the next
        valid request (of a batch too) is served as usual.
        """
        if len(frames) > 1 and frames[0].bytes == _GENERATE_BATCH:
            try:
                parts = split_generate_batch(frames)
            except WireFormatError as exc:
                self._refuse_malformed(exc, None)
                return
            for part in parts:
                self._handle_request([_GENERATE_FRAME, *part])
            return
        self._handle_request(frames)

    def _handle_request(self, frames: list[zmq.Frame]) -> None:
        try:
            req_type, msg = decode_frames(frames, REQUEST_TYPES, self._decoders)
        except WireFormatError as exc:
            self._refuse_malformed(exc, guess_request_id(frames))
            return
        if req_type is StageRequestType.RELEASE:
            if self.pool is not None:
                self.pool.release(msg.segments)  # names not leased (any more) are ignored
            return
        self._deliver(req_type, msg)

    def _refuse_malformed(self, exc: WireFormatError, request_id: str | None) -> None:
        where = f"stage {self.stage_id}: malformed request message" + (
            f" for request {request_id!r:.100}" if request_id is not None else "")
        logger.warning("%s dropped: %s", where, exc)
        self._send_error(f"{where}: {exc}", request_id, MALFORMED_MESSAGE)

    def _deliver(self, req_type: StageRequestType, msg: Any) -> None:
        """Hand a decoded request to the core (here: on its loop already)."""
        self._dispatch(req_type, msg)

    # --------------------------------------------------------- output side
    def _send_collected(self, items: list[Any]) -> None:
        if self._responses_out is not None:  # (closed: the client is gone, nobody to tell)
            self._send_items(self._responses_out, items)

    def _send_items(self, sock: zmq.Socket | LoopSocket, items: list[Any]) -> None:
        """Send ``items`` in order, consecutive outputs as one message."""
        outputs: list[Any] = []  # StageRequestOutput, or an llm stage's OmniRequestOutput
        timings: dict[str, StageTiming] = {}
        ended: list[str] = []
        for item in items:
            rtype, payload = item
            if rtype is _OUTPUT:
                outputs.append(payload)
                continue
            if rtype is TIMED_OUTPUT:
                output, timings[payload[0].request_id] = payload
                outputs.append(output)
                continue
            if rtype is REQUEST_DONE:
                # A model wrote into slots (empty_output) it did not send: they may go back once
                # the request's outputs are encoded. Only then does the marker split the outputs.
                ended.append(payload)
                if payload in self.pool.unsent:
                    self._send_outputs(sock, outputs, timings)
                    outputs, timings = [], {}
                    self.pool.release_unsent(payload)
                continue
            self._send_outputs(sock, outputs, timings)
            outputs, timings = [], {}
            self._send(sock, rtype, payload)
        self._send_outputs(sock, outputs, timings)
        meter = self._encoder.shm_meter
        if meter:  # (after the sends: a request's last outputs may be in this very batch)
            for request_id in ended:
                meter.pop(request_id, None)

    def _send_outputs(self, sock: zmq.Socket | LoopSocket, outputs: list[Any],
                      timings: dict[str, StageTiming]) -> None:
        if not outputs:
            return
        try:
            self._send(sock, _OUTPUT, StageOutputs(outputs, time.time(), timings or None), strict=True)
        except TypeError:
            # One output the wire cannot carry must not take the others down.
            for output in outputs:
                timing = timings.get(output.request_id) if output.finished else None
                try:
                    self._send(sock, _OUTPUT, StageOutputs(
                        [output], time.time(), {output.request_id: timing} if timing else None), strict=True)
                except TypeError as exc:
                    self._send(sock, StageResponseType.ERROR, StageError(
                        f"stage {self.stage_id}: output of request {output.request_id!r} cannot be sent: {exc}",
                        output.request_id, "TypeError"))

    def _send(self, sock: zmq.Socket | LoopSocket, rtype: StageResponseType, payload: Any,
              strict: bool = False) -> None:
        try:
            bufs = self._encoder.encode(payload)
        except TypeError:
            if strict:
                raise
            logger.exception("stage %d: cannot encode %s message", self.stage_id, rtype.name)
            return
        sock.send_multipart([rtype.value, *bufs], copy=False)
