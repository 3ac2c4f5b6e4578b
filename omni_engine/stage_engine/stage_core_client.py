"""Client side of one stage (vLLM's ``AsyncMPClient`` pattern).

The client binds a ROUTER (requests out) and a PULL (responses in); the stage
process connects a DEALER and a PUSH. One asyncio task reads the PULL socket
and one loop reader watches the stage's process sentinel, so a stage that
dies, even by ``kill -9``, fails every waiter at once: no polling, no timeouts
in the data path.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import itertools
import logging
import weakref
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from omni_engine import envs
from omni_engine.connectors.leases import ShmLeaseBook, lease_book_for
from omni_engine.connectors.settings import ConnectorSettings
from omni_engine.connectors.semaphores import remove_orphan_semaphores
from omni_engine.connectors.shm import (
    ShmAttachments,
    default_attachments,
    new_run_prefix,
    remove_stale_segments,
    stage_prefix,
    unlink_prefix,
)
from omni_engine.errors import StageDeadError
from omni_engine.stage_engine import security
from omni_engine.stage_engine.base_client import BaseStageClient
from omni_engine.wire.protocol import (
    RESPONSE_STRUCTS,
    RESPONSE_TYPES,
    StageReady,
    StageReleaseRequest,
    StageRequestType,
    StageResponseType,
    decode_frames,
    message_kind,
)
from omni_engine.stage_engine.security import CurveKeys
from omni_engine.stage_engine.stage_launch import LaunchedStage, launch_spec, new_runtime_dir, start_stage_process
from omni_engine.stage_engine.stage_process import StageProcess, StageProcessSpec, cleanup_stage
from omni_engine.stage_engine.loop_socket import LoopSocket
from omni_engine.stage_engine.stage_spec import StageTransport
from omni_engine.utils import machine_host_id
from omni_engine.wire.stage_serialization import (
    ForeignShmHandleError,
    StageMsgpackDecoder,
    StageMsgpackEncoder,
    WireFormatError,
)
from omni_engine.stage_engine.stage_sockets import bind_client_sockets, make_addresses, remove_stale_runtime_dirs
from omni_engine.stage_engine.stage_startup import (
    check_ready,
    recv_ready,
)

logger = logging.getLogger(__name__)

# The GENERATEs of one loop turn leave as one message, but in pieces of at most this many: a
# turn that submits hundreds would otherwise leave the stage idle until its end, then flood it
# (with 32 the stage works on the first piece while the client encodes the rest).
GENERATES_PER_MESSAGE = 32


class ShmRequestResources:
    """The shared-memory slots a stage's outputs hold, per request (``RequestResources``).

    A slot goes back to the stage once its request has ended here and every
    view decoded from it is gone (the loop's ``ShmLeaseBook`` decides); a stage
    that is gone has its segments detached and unlinked.
    """

    def __init__(self, attachments: ShmAttachments) -> None:
        self.attachments = attachments
        self.book: ShmLeaseBook | None = None  # the loop's, set at start
        self.producer_prefix: str | None = None  # the stage's, set at READY

    def begin(self, request_id: str) -> None:
        if request_id in self.book.ended:  # an id used again: its new slots wait for its new end
            self.book.begin_request(request_id)

    def end(self, request_id: str, open_: bool = False) -> None:
        # The book remembers a request as ended only where that matters: it holds slots, or
        # outputs (with handles) may still come. A request that finished without any (text)
        # costs the book nothing: the stage sends nothing after a final output.
        if open_ or request_id in self.book.slots_by_request:
            self.book.end_request(request_id)

    def close(self) -> None:
        prefix = self.producer_prefix
        if prefix is not None:
            self.book.remove_producer(prefix)
            self.attachments.detach(prefix=prefix)
            unlink_prefix(prefix)


class StageEngineCoreClient(BaseStageClient):
    """Talks to one stage process: submit, stream outputs, abort, health, utility calls.

    With ``process`` given, ``start()`` spawns the stage and waits for its
    READY; without, it waits for an externally started stage to connect.
    ``host`` is the tcp bind address (default loopback). With ``curve`` (the
    pipeline's keys) the sockets admit only peers with an allowed client key,
    and a spawned stage gets the client keypair in its spec. With ``launched``
    (``stage_launch.launch_stage``: the process already runs), ``start()`` binds
    the addresses it connects to and adopts it instead of spawning one.
    """

    def __init__(
        self,
        stage_id: int,
        input_address: str | None = None,
        output_address: str | None = None,
        *,
        process: StageProcessSpec | None = None,
        transport: str = "ipc",
        host: str | None = None,
        curve: CurveKeys | None = None,
        startup_timeout: float | None = None,
        attachments: ShmAttachments | None = None,
        lease_book: ShmLeaseBook | None = None,
        run_prefix: str | None = None,
        connectors: ConnectorSettings | None = None,
        launched: LaunchedStage | None = None,
    ) -> None:
        """``connectors`` default to the process spec's (else the environment's):
        both ends must agree on them (pickle above all)."""
        make_addresses(stage_id, transport, Path(), host)  # ValueError naming the stage if unusable
        if launched is not None:
            if transport != "ipc" or curve is not None or process is None:
                raise ValueError(f"stage {stage_id}: a launched stage is a local ipc stage without CURVE, "
                                 "with its process spec")
            input_address, output_address = launched.input_address, launched.output_address
            run_prefix = launched.run_prefix
        self.launched = launched
        attachments = attachments or default_attachments()
        self.shm = ShmRequestResources(attachments)
        super().__init__(stage_id, process, startup_timeout, self.shm)
        self.connectors = connectors or (process.connectors if process is not None else envs.connector_settings())
        self.transport = transport
        self.host = host
        self.curve = curve
        self._auth: Any = None  # the ZAP authenticator, with CURVE
        # Addresses default to fresh ones made at start(), in ``runtime_dir``.
        self.input_address = input_address
        self.output_address = output_address
        # A private directory for this stage's socket files (ours and vLLM's
        # own, via VLLM_RPC_BASE_PATH), removed whole at shutdown: even a
        # stage killed with SIGKILL leaves no socket file behind.
        self.runtime_dir: Path | None = None
        self.run_prefix = run_prefix or new_run_prefix()
        self.shm_prefix = stage_prefix(self.run_prefix, stage_id)
        self.attachments = attachments
        self.shm.book = lease_book  # default: the loop's, at start()
        self._ctx: zmq.asyncio.Context | None = None
        self._input: zmq.asyncio.Socket | None = None
        self._output: zmq.asyncio.Socket | None = None
        self._identity: bytes | None = None
        self._encoder = StageMsgpackEncoder.from_settings(self.connectors)
        self._decoders: dict[StageResponseType, StageMsgpackDecoder] = {}
        self._output_reader: LoopSocket | None = None
        self._requests_out: LoopSocket | None = None  # the ROUTER after READY: sends, and strays read
        # GENERATEs submitted this loop turn after its first, sent together at its end (None: none
        # was submitted this turn yet).
        self._turn_generates: list[list[Any]] | None = None
        self._finalizer: weakref.finalize | None = None
        # This end's shared-memory domain; a stage that reports another gets and sends frames only.
        self.host_id = machine_host_id()
        # A stage that says it is alive every so often (one on another host): silence for this
        # long is its loss, or its node's (None: the process sentinel alone tells).
        self.heartbeat_timeout: float | None = None
        self._last_heard = 0.0
        self._heartbeat_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind, launch the stage (if configured) and wait for its READY."""
        self._loop = asyncio.get_running_loop()
        remove_stale_segments()
        remove_orphan_semaphores()
        if self.shm.book is None:
            self.shm.book = lease_book_for(self._loop)
        remove_stale_runtime_dirs()
        self.runtime_dir = self.launched.runtime_dir if self.launched is not None else new_runtime_dir(self.stage_id)
        default_in, default_out = make_addresses(self.stage_id, self.transport, self.runtime_dir, self.host)
        self.input_address = self.input_address or default_in
        self.output_address = self.output_address or default_out
        self._ctx = zmq.asyncio.Context()
        if self.curve is not None:
            self._auth = security.start_authenticator(self._ctx, self.curve)
        self._input, self._output = bind_client_sockets(self._ctx, self.stage_id, self.input_address,
                                                        self.output_address, self.curve)
        self.input_address = self._input.getsockopt_string(zmq.LAST_ENDPOINT)
        self.output_address = self._output.getsockopt_string(zmq.LAST_ENDPOINT)
        decoder_args = dict(shm=self.attachments, on_shm_view=self._on_shm_view,
                            allow_pickle=self.connectors.allow_pickle)
        self._decoders = {t: StageMsgpackDecoder(cls, **decoder_args) for t, cls in RESPONSE_STRUCTS.items()}
        self._finalizer = weakref.finalize(self, cleanup_stage, None, self.runtime_dir, self.shm_prefix, self._ctx)
        atexit.register(self._finalizer)
        try:
            if self.launched is not None:
                self._adopt(self.launched)
            elif self.process_spec is not None:
                await self._launch()
            await self._wait_ready(" (with CURVE on, a stage whose keys the client refuses never gets through)"
                                   if self.curve is not None else "")
        except BaseException:
            await self.shutdown()
            raise
        self._meet_host(self.ready.host_id)
        self.shm.producer_prefix = self.ready.shm_prefix
        self.shm.book.add_producer(self.ready.shm_prefix, self._send_release)
        self._output_reader = LoopSocket(self._loop, self._output, self._take_response, self._on_reader_failed)
        self._requests_out = LoopSocket(self._loop, self._input, self._on_stray_request_frames,
                                        self._on_reader_failed, copy=True)
        self._watch_process()
        self._watch_heartbeats()

    async def _launch(self) -> None:
        self._own_process(await self._start_process(self._launch_spec()))

    def _adopt(self, launched: LaunchedStage) -> None:
        launched.adopted = True
        self._own_process(launched.process)
        if launched.process.waiting_spare:
            # Its addresses, socket directory and prefix are ours already; the rest is this replica's.
            launched.process.take(self._launch_spec())

    def _own_process(self, process: StageProcess) -> None:
        self.process = process
        # The finalizer (GC, atexit) kills the stage if shutdown() never runs.
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, cleanup_stage, self.process, self.runtime_dir, self.shm_prefix, self._ctx
        )
        atexit.register(self._finalizer)

    def _launch_spec(self) -> StageProcessSpec:
        """The process spec with its launch fields: where to connect, keys, connectors."""
        return launch_spec(self.process_spec, self.runtime_dir, self.connectors, self._stage_transport(), self.curve)

    def _stage_transport(self) -> StageTransport:
        return StageTransport(input_address=self.input_address, output_address=self.output_address,
                              shm_prefix=self.shm_prefix)

    async def _start_process(self, spec: StageProcessSpec) -> StageProcess:
        """Start the stage's process (here: a child of this one)."""
        return start_stage_process(self.stage_id, spec, self.shm_prefix)

    def _meet_host(self, host_id: str) -> None:
        """After READY: a stage on another host can neither map our segments nor we its, so from
        now on tensors to it go as frames and a handle from it is refused (``_take_response``)."""
        if not host_id or host_id == self.host_id:
            return
        logger.info("stage %d runs on host %s (this client: %s): tensors travel as ZMQ frames",
                    self.stage_id, host_id, self.host_id)
        self.connectors = msgspec.structs.replace(self.connectors, use_shm=False)
        self._encoder = StageMsgpackEncoder.from_settings(self.connectors)
        for decoder in self._decoders.values():
            decoder.foreign_host = host_id

    def _watch_heartbeats(self) -> None:
        if self.heartbeat_timeout is not None:
            self._last_heard = self._loop.time()
            self._schedule_heartbeat_check()

    def _schedule_heartbeat_check(self) -> None:
        self._heartbeat_timer = self._loop.call_later(self.heartbeat_timeout / 10, self._check_heartbeats)

    def _check_heartbeats(self) -> None:
        """Dead after ``heartbeat_timeout`` of silence, found within 1.1 times it (checked ten times
        a timeout). A message waiting unread is no silence: this loop was late, not the stage."""
        if self.dead_error is not None or self._stopped:
            return  # (a stage being stopped goes quiet on purpose)
        quiet = self._loop.time() - self._last_heard
        waiting = self._output.getsockopt(zmq.EVENTS) & zmq.POLLIN
        self._output_reader.check()  # (reading EVENTS may have taken the edge the reader waits for)
        if quiet >= self.heartbeat_timeout and not waiting:
            self._set_dead(StageDeadError(
                self.stage_id, f"stage {self.stage_id} (pid {self.ready.pid} on host {self.ready.host_id}) sent "
                               f"nothing for {quiet:.1f} s, heartbeats included: its process or its node is lost"))
            return
        self._schedule_heartbeat_check()

    async def _recv_ready(self) -> StageReady:
        check = functools.partial(check_ready, stage_id=self.stage_id, shm_prefix=self.shm_prefix,
                                  process=self.process)
        self._identity, ready = await recv_ready(self._input, self.stage_id, check)
        return ready

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the stage and release every socket, file and segment. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._input is not None:
            await self._stop_process(timeout)
        self._release_now()

    def _release_now(self) -> None:
        if self.launched is not None:
            self.launched.discard()  # a launched stage this client never adopted (it never started)
        for watch in (self._output_reader, self._requests_out):
            if watch is not None:
                watch.close()
        if self._heartbeat_timer is not None:
            self._heartbeat_timer.cancel()
        # (Through self.shm.close(): the stage's producer leaves the lease book, its segments are unlinked.)
        super()._release_now()
        if self._auth is not None:
            self._auth.stop()
        if self._finalizer is not None:
            self._finalizer()  # closes the sockets (the context), the socket directory, the stage's segments
        self.attachments.detach(prefix=self.shm_prefix)

    def _send_nowait(self, req_type: StageRequestType, msg: Any) -> bool:
        if self._identity is None:
            return False
        # The asyncio socket's own handle, used synchronously: nothing else uses it now.
        socket = zmq.Socket.shadow(self._input.underlying)
        try:
            socket.send_multipart([self._identity, req_type.value, *self._encoder.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    # --------------------------------------------------------- shared memory
    @property
    def lease_book(self) -> ShmLeaseBook | None:
        return self.shm.book

    # ------------------------------------------------------------- transport
    async def _send(self, req_type: StageRequestType, msg: Any) -> None:
        bufs = self._encoder.encode(msg)
        self.bytes_sent += sum(memoryview(b).nbytes for b in bufs)
        if self._requests_out is None:  # (SHUTDOWN during startup)
            await self._input.send_multipart([self._identity, req_type.value, *bufs], copy=False)
            return
        if req_type is StageRequestType.GENERATE:
            if self._turn_generates is not None:
                # Not the first of this loop turn: it goes with the others, at the turn's end or in a full piece.
                self._turn_generates.append(bufs)
                if len(self._turn_generates) >= GENERATES_PER_MESSAGE:
                    self._send_generates()  # the stage starts on these while this turn goes on
                return
            self._turn_generates = []
            self._loop.call_soon(self._end_generate_turn)
        elif self._turn_generates:
            self._send_generates()  # nothing may overtake a GENERATE (an ABORT of it above all)
        await self._send_frames([self._identity, req_type.value, *bufs])

    async def _send_frames(self, frames: list[Any]) -> None:
        try:
            if not self._requests_out.send_multipart(frames):
                await self._requests_out.flushed()  # the stage's queue is full: wait for room, in order
        except zmq.ZMQError as exc:
            raise self._unreachable(exc) from None

    def _end_generate_turn(self) -> None:
        if self._turn_generates:
            self._send_generates()
        self._turn_generates = None

    def _send_generates(self) -> None:
        """The GENERATEs held back this turn, as one message (a batch's errors reach its requests
        through the stage's death: they have been submitted)."""
        batch, self._turn_generates = self._turn_generates, []
        if len(batch) == 1:
            frames = [self._identity, StageRequestType.GENERATE.value, *batch[0]]
        else:
            counts = msgspec.msgpack.encode([len(bufs) for bufs in batch])
            frames = [self._identity, StageRequestType.GENERATE_BATCH.value, counts,
                      *itertools.chain.from_iterable(batch)]
        if self.dead_error is not None or self._requests_out is None or self._requests_out.closed:
            return  # (its requests failed with the stage)
        try:
            self._requests_out.send_multipart(frames)  # (a full socket keeps it; the next send waits for room)
        except zmq.ZMQError as exc:
            if not isinstance(self._unreachable(exc), StageDeadError):  # requests that never left would hang
                self._set_dead(StageDeadError(self.stage_id, f"stage {self.stage_id}: requests could not be "
                                                             f"sent: {exc}"), notify=not self._stopped)

    def _unreachable(self, exc: zmq.ZMQError) -> BaseException:
        """A failed send: the stage is dead if it is unreachable (returned, to raise), else ``exc``."""
        if exc.errno == zmq.EHOSTUNREACH:
            return self._set_dead(StageDeadError(self.stage_id, f"stage {self.stage_id} is unreachable "
                                                                "(disconnected)"), notify=not self._stopped)
        return exc

    def _on_stray_request_frames(self, frames: list[bytes]) -> None:
        """After READY nothing should arrive on the ROUTER: log and drop whatever does (unread it
        would sit in ZMQ's queue; read, a second READY, a stage that restarted or a stranger, is
        at least visible in the log)."""
        logger.warning("stage %d: unexpected %s from peer %s on the request socket dropped",
                       self.stage_id, message_kind(frames, RESPONSE_TYPES), frames[0].hex())

    def _on_shm_view(self, name: str, owner: str | None, view: memoryview) -> None:
        self.bytes_received += view.nbytes
        # An owner not in flight here (aborted, or never ours) will never end
        # through us: free the slot with its last view, not at a request end.
        if owner is not None and owner not in self._requests:
            owner = None
        self.shm.book.on_view(name, owner, view)

    def _send_release(self, names: list[str]) -> None:
        if self.dead_error is None and self._identity is not None and not self._stopped:
            task = asyncio.ensure_future(self._send(StageRequestType.RELEASE, StageReleaseRequest(names)))
            # A stage that went away meanwhile frees its pool itself.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _on_reader_failed(self, exc: BaseException) -> None:
        """Reading outputs failed (a malformed message is dropped, not this): every waiter
        would hang, so the stage is marked dead, loudly."""
        logger.error("stage %d: output handler failed", self.stage_id, exc_info=exc)
        self._set_dead(StageDeadError(self.stage_id, f"stage {self.stage_id}: output handler failed: "
                                                     f"{type(exc).__name__}: {exc}"))

    def _take_response(self, frames: list[zmq.Frame]) -> None:
        """One message from the stage: counted, decoded and handled; a malformed one is dropped."""
        self.bytes_received += sum(len(f) for f in frames)
        self._last_heard = self._loop.time()
        try:
            self._handle_response(frames)
        except ForeignShmHandleError as exc:
            # Not noise: a stage that breaks the handshake's promise cannot be trusted with more requests.
            self._set_dead(StageDeadError(self.stage_id, f"stage {self.stage_id}: {exc}; it is stopped"))
        except WireFormatError as exc:
            logger.warning("stage %d: malformed response dropped: %s", self.stage_id, exc)

    def _handle_response(self, frames: list[zmq.Frame]) -> None:
        self._on_response(*decode_frames(frames, RESPONSE_TYPES, self._decoders))
