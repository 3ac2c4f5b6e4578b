"""The stage's engine side: ``StageEngineCore`` and ``StageEngineCoreProc`` (vLLM's ``core.py`` shape).

``StageEngineCore`` is the request handling of a stage (one task per request,
abort, health, utility calls, a fatal error ending the stage), which does not
depend on how requests arrive and answers leave: the legacy architecture
(``omni_engine.legacy``) carries them over ``multiprocessing.Queue``.

``StageEngineCoreProc`` carries them over ZMQ (vLLM's ``EngineCoreProc``
pattern), with three threads so that socket I/O and (de)serialization overlap
with compute:

* the input thread receives and decodes requests from the DEALER socket and
  hands them to the event loop (``call_soon_threadsafe``);
* the event loop (uvloop) runs the engine: one task per request;
* the output thread encodes and sends on the PUSH socket. It blocks for the
  first item and then drains whatever else is ready, so outputs produced at
  the same time leave in one ``StageOutputs`` message.

Nothing here polls: each thread blocks on its socket or queue.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import threading
import time
from typing import Any, ClassVar, Protocol

import msgspec
import uvloop
import zmq

from omni_engine.connectors.settings import DEFAULT_CONNECTORS, ConnectorSettings
from omni_engine.connectors.shm import (
    ShmAttachments,
    ShmPool,
    new_run_prefix,
    owner_process_prefix,
    set_output_pool,
    stage_prefix,
)
from omni_engine.engines.base import StageEngine, StageEngineError
from omni_engine.outputs import OmniRequestOutput, aborted_output
from omni_engine.stage_engine import security
from omni_engine.stage_engine.security import StageCurveKeys
from omni_engine.stage_engine.stage_sockets import open_stage_socket
from omni_engine.utils import call_quietly, machine_host_id
from omni_engine.wire.protocol import (
    DUPLICATE_REQUEST,
    MALFORMED_MESSAGE,
    REQUEST_STRUCTS,
    REQUEST_TYPES,
    StageDead,
    StageError,
    StageGenerateRequest,
    StageHealth,
    StageHealthCheck,
    StageHeartbeat,
    StageOutputs,
    StageReady,
    StageRequestType,
    StageResponseType,
    StageUtilityRequest,
    StageUtilityResult,
    decode_frames,
    guess_request_id,
)
from omni_engine.wire.stage_serialization import (
    StageMsgpackDecoder,
    StageMsgpackEncoder,
    WireFormatError,
)

logger = logging.getLogger(__name__)

_OUTPUT = StageResponseType.OUTPUT
# Seconds an aborted request's engine has to end its stream with its own final
# output (vLLM's does at once, with the partial text) before the stage cancels
# it and sends an empty final output itself.
ABORT_GRACE_S = 1.0

_STOP = object()
# Output-queue marker: every output of this request is encoded once the marker is reached.
_REQUEST_DONE = object()


class ResponseSink(Protocol):
    """Where answers go: ``put((StageResponseType, payload))``, thread-safe, non-blocking."""

    def put(self, item: Any) -> None: ...


class StageEngineCore:
    """Runs one ``StageEngine`` on a uvloop event loop; subclasses add the transport."""

    # Utility calls the stage process answers itself (not its engine).
    PROC_UTILITY_METHODS: ClassVar[frozenset[str]] = frozenset({"num_unfinished_requests"})
    # SIGTERM/SIGINT end the stage when it runs on its process's main thread. A stage in the
    # client's process leaves the process's signals to the client.
    HANDLES_SIGNALS: ClassVar[bool] = True

    def __init__(self, stage_id: int, engine: StageEngine, out_q: ResponseSink) -> None:
        self.stage_id = stage_id
        self.engine = engine
        self._out_q = out_q
        self._requests: dict[str, asyncio.Task] = {}
        # Aborted requests whose streams are ending (their final output still to send).
        self._aborting: dict[str, asyncio.Task] = {}
        self._exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown: asyncio.Event | None = None

    # ------------------------------------------------------------ transport
    def _start_transport(self) -> None:
        """Start receiving requests (after the engine is loaded); announce READY."""
        raise NotImplementedError

    async def _stop_transport(self) -> None:
        """Flush what is queued for the client and release the transport."""
        raise NotImplementedError

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        """Serve on a uvloop of its own until SHUTDOWN, a signal, or a fatal engine error;
        returns the exit code."""
        return uvloop.run(self.serve())

    async def serve(self) -> int:
        """``run`` on the running loop (a stage on its client's loop)."""
        self._loop = asyncio.get_running_loop()
        self._shutdown = asyncio.Event()
        await self.engine.start()
        self._start_transport()
        if self.HANDLES_SIGNALS and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        logger.info("stage %d ready (pid %d)", self.stage_id, os.getpid())
        try:
            await self._shutdown.wait()
        finally:
            if self._loop.is_closed():
                # Collected after its loop closed (a stage on a client's loop that was closed
                # under it): nothing can be awaited, and the transport is all that can be freed.
                self._abandon_transport()
            else:
                await self._wind_down()
        return self._exit_code

    async def _wind_down(self) -> None:
        tasks = list(self._requests.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self.engine.shutdown()
        except Exception:  # noqa: BLE001 - shutting down regardless
            logger.exception("stage %d: engine shutdown failed", self.stage_id)
        await self._stop_transport()

    def _abandon_transport(self) -> None:
        """Release the transport without the event loop (which is closed)."""

    def num_unfinished_requests(self) -> int:
        """Requests this stage still holds anything for.

        A request in flight has a task here and state in the engine (vLLM's
        output processor, the batcher's queue); either one outliving the
        request is a leak, so the larger of the two counts is reported.
        """
        return max(len(self._requests), self.engine.num_unfinished_requests())

    def _dispatch_threadsafe(self, req_type: StageRequestType, msg: Any) -> None:
        """Hand a decoded request from a transport thread to the event loop."""
        self._call_threadsafe(self._dispatch, req_type, msg)

    def _call_threadsafe(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed: shutting down
            pass

    def _dispatch(self, req_type: StageRequestType, msg: Any) -> None:
        if req_type is StageRequestType.GENERATE:
            self._add_request(msg)
        elif req_type is StageRequestType.ABORT:
            # Free the ids now, not in a task: a GENERATE right behind the ABORT may reuse one.
            aborted = {rid: task for rid in msg.request_ids if (task := self._requests.pop(rid, None)) is not None}
            if msg.final_outputs:
                # The aborted streams end with their final outputs; a reused id starts after that.
                self._aborting.update(aborted)
            else:
                for task in aborted.values():
                    task.cancel()
            if aborted:
                asyncio.create_task(self._abort(aborted))
        elif req_type is StageRequestType.HEALTH_CHECK:
            asyncio.create_task(self._health(msg))
        elif req_type is StageRequestType.UTILITY:
            asyncio.create_task(self._utility(msg))
        elif req_type is StageRequestType.SHUTDOWN:
            assert self._shutdown is not None
            self._shutdown.set()

    def _fatal(self, exc: BaseException, tell_client: bool = True) -> None:
        """The stage can no longer serve: tell the client (DEAD), then exit.

        Not telling is for a client we never reached (failed handshake): a PUSH
        without a peer blocks, and the exit must not wait on it.
        """
        logger.error("stage %d: fatal error: %r", self.stage_id, exc)
        self._die(f"stage {self.stage_id}: {type(exc).__name__}: {exc}", 1, tell_client)

    def _on_signal(self, sig: int) -> None:
        """SIGTERM/SIGINT end the stage as a crash does: the client hears DEAD at once.

        The client stops a stage with SHUTDOWN; a signal comes from someone
        else (an operator, a supervisor, the client's death via PDEATHSIG),
        so the requests in flight fail now, naming the stage and the signal,
        instead of when the process is finally gone.
        """
        name = signal.Signals(sig).name
        logger.warning("stage %d: received %s; exiting", self.stage_id, name)
        self._die(f"stage {self.stage_id}: terminated by {name}", 128 + sig)

    def _die(self, message: str, exit_code: int, tell_client: bool = True) -> None:
        assert self._shutdown is not None
        if self._shutdown.is_set():
            return  # already on its way out
        if tell_client:
            self._out_q.put((StageResponseType.DEAD, StageDead(message)))
        self._exit_code = exit_code
        self._shutdown.set()

    # ---------------------------------------------------------- handlers
    def _add_request(self, req: StageGenerateRequest) -> None:
        rid = req.request_id
        if rid in self._requests:
            self._send_error(f"stage {self.stage_id}: GENERATE for request {rid!r} refused: that request id is "
                             "already running", rid, DUPLICATE_REQUEST)
            return
        task = asyncio.create_task(self._generate(req, self._aborting.get(rid)), name=f"stage{self.stage_id}-{rid}")
        self._requests[rid] = task
        task.add_done_callback(lambda t, rid=rid: self._request_done(rid, t))

    def _request_done(self, rid: str, task: asyncio.Task) -> None:
        if self._requests.get(rid) is task:
            del self._requests[rid]
        if self._aborting.get(rid) is task:
            del self._aborting[rid]
        self._on_request_done(rid)

    def _on_request_done(self, request_id: str) -> None:
        """A request's task ended (finished, failed or aborted); its outputs are queued."""

    async def _generate(self, req: StageGenerateRequest, aborted_before: asyncio.Task | None = None) -> None:
        """Run one request, sending its outputs. Aborted, it still ends with one final output
        (finish_reason "abort", the partial text where the engine has it), as vLLM's AsyncLLM does."""
        if aborted_before is not None:
            # The aborted request with this id sends its final output first.
            await asyncio.wait([aborted_before])
        put = self._out_q.put
        finished = False
        try:
            async for output in self.engine.generate(req.request_id, req.prompt, req.sampling_params):
                put((_OUTPUT, output))
                finished = output.finished
            if not finished and self._is_aborting(req.request_id):
                put((_OUTPUT, self._abort_output(req.request_id)))
        except asyncio.CancelledError:
            if not finished and self._is_aborting(req.request_id):
                put((_OUTPUT, self._abort_output(req.request_id)))
            raise
        except StageEngineError as exc:
            self._send_error(f"stage {self.stage_id}: request {req.request_id!r} failed: {exc}", req.request_id,
                             type(exc).__name__)
            self._fatal(exc)
        except Exception as exc:  # noqa: BLE001 - a request failure is not a stage failure
            logger.info("stage %d: request %s failed", self.stage_id, req.request_id, exc_info=True)
            self._send_error(f"stage {self.stage_id}: request {req.request_id!r} failed: {type(exc).__name__}: {exc}",
                             req.request_id, type(exc).__name__)

    def _is_aborting(self, request_id: str) -> bool:
        return self._aborting.get(request_id) is asyncio.current_task()

    def _abort_output(self, request_id: str) -> OmniRequestOutput:
        return aborted_output(request_id, self.stage_id, self.engine.output_type)

    async def _abort(self, aborted: dict[str, asyncio.Task]) -> None:
        # Spare a new request with an aborted one's id: one that ending aborted
        # streams wait for starts once the old one is done; a cancelled one's
        # id may be running again already.
        request_ids = [rid for rid, task in aborted.items()
                       if (not task.done() if self._aborting.get(rid) is task else rid not in self._requests)]
        if not request_ids:
            return
        try:
            await self.engine.abort(request_ids)
        except StageEngineError as exc:
            self._fatal(exc)
        except Exception:  # noqa: BLE001
            logger.exception("stage %d: abort of %s failed", self.stage_id, request_ids)
        # An engine that did not end the stream (it had not seen the request yet) is cut off.
        _, running = await asyncio.wait(list(aborted.values()), timeout=ABORT_GRACE_S)
        for task in running:
            task.cancel()

    async def _health(self, msg: StageHealthCheck) -> None:
        healthy = True
        try:
            await self.engine.check_health()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            logger.warning("stage %d: health check failed: %r", self.stage_id, exc)
            healthy = False
        self._out_q.put((StageResponseType.HEALTH, StageHealth(msg.call_id, healthy, len(self._requests), os.getpid())))

    async def _utility(self, msg: StageUtilityRequest) -> None:
        result = StageUtilityResult(msg.call_id)
        if msg.method in self.PROC_UTILITY_METHODS:
            result.result = getattr(self, msg.method)()
        elif msg.method not in self.engine.UTILITY_METHODS:
            result.error = (f"stage {self.stage_id} ({type(self.engine).__name__}) has no utility method "
                            f"{msg.method!r}; available: {sorted(self.engine.UTILITY_METHODS)}")
        else:
            try:
                value = getattr(self.engine, msg.method)(*msg.args, **msg.kwargs)
                result.result = await value if asyncio.iscoroutine(value) else value
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                result.error = f"stage {self.stage_id}: {msg.method} failed: {type(exc).__name__}: {exc}"
        self._out_q.put((StageResponseType.UTILITY_RESULT, result))

    def _send_error(self, message: str, request_id: str | None, error_type: str) -> None:
        self._out_q.put((StageResponseType.ERROR, StageError(message, request_id, error_type)))


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
                if payload in self.pool.unsent:  # a model wrote into slots (empty_output) it did not send
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
