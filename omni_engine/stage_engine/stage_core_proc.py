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

import asyncio
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

import msgspec
import uvloop
import zmq

from omni_engine import envs
from omni_engine.connectors.shm import (
    ShmAttachments,
    ShmPool,
    new_run_prefix,
    stage_prefix,
)
from omni_engine.engines.base import StageEngine, StageEngineError
from omni_engine.outputs import OmniRequestOutput
from omni_engine.stage_engine.protocol import (
    REQUEST_STRUCTS,
    StageAbortRequest,
    StageDead,
    StageError,
    StageGenerateRequest,
    StageHealth,
    StageHealthCheck,
    StageOutputs,
    StageReady,
    StageRequestType,
    StageResponseType,
    StageUtilityRequest,
    StageUtilityResult,
)
from omni_engine.stage_engine.stage_serialization import (
    StageMsgpackDecoder,
    StageMsgpackEncoder,
)
from omni_engine.utils import call_quietly, die_with_parent

logger = logging.getLogger(__name__)

_STOP = object()
# Utility calls the stage process answers itself (not its engine).
PROC_UTILITY_METHODS = frozenset({"shm_stats"})
_OUTPUT = StageResponseType.OUTPUT


class StageEngineCoreProc:
    """Serves one engine on a DEALER (requests in) and a PUSH (responses out) socket."""

    def __init__(
        self,
        stage_id: int,
        engine: StageEngine,
        input_address: str,
        output_address: str,
        shm_prefix: str | None = None,
    ) -> None:
        self.stage_id = stage_id
        self.engine = engine
        self.input_address = input_address
        self.output_address = output_address
        self.shm_prefix = shm_prefix or stage_prefix(new_run_prefix(), stage_id)
        # OMNI_ENGINE_USE_SHM=0: every tensor travels as a ZMQ frame.
        self.pool = ShmPool(self.shm_prefix) if envs.use_shm() else None
        self.attachments = ShmAttachments()
        self.ctx = zmq.Context()
        self._out_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._requests: dict[str, asyncio.Task] = {}
        self._wake_address = f"inproc://stage-input-wake-{id(self)}"
        self._exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown: asyncio.Event | None = None

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        """Serve until SHUTDOWN, a signal, or a fatal engine error; returns the exit code."""
        return uvloop.run(self._run())

    async def _run(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._shutdown = asyncio.Event()
        await self.engine.start()
        wake = self.ctx.socket(zmq.PAIR)
        wake.bind(self._wake_address)
        threads = [
            threading.Thread(target=self._output_thread, name="stage-output", daemon=True),
            threading.Thread(target=self._input_thread, name="stage-input", daemon=True),
        ]
        for thread in threads:
            thread.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._shutdown.set)
        logger.info("stage %d ready (pid %d)", self.stage_id, os.getpid())
        try:
            await self._shutdown.wait()
        finally:
            await self._cleanup(wake, threads)
        return self._exit_code

    async def _cleanup(self, wake: zmq.Socket, threads: list[threading.Thread]) -> None:
        tasks = list(self._requests.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self.engine.shutdown()
        except Exception:  # noqa: BLE001 - shutting down regardless
            logger.exception("stage %d: engine shutdown failed", self.stage_id)
        self._out_q.put(_STOP)
        wake.send(b"")
        for thread in threads:
            thread.join(timeout=10)
        wake.close(linger=0)
        if self.pool is not None:
            call_quietly(self.pool.close, "unlinking shared memory")
        call_quietly(lambda: self.attachments.detach(), "detaching shared memory")
        self.ctx.term()

    def _fatal(self, exc: BaseException) -> None:
        """The engine can no longer serve: tell the client (DEAD), then exit."""
        logger.error("stage %d: fatal engine error: %r", self.stage_id, exc)
        self._out_q.put((StageResponseType.DEAD, StageDead(f"stage {self.stage_id}: {type(exc).__name__}: {exc}")))
        self._exit_code = 1
        assert self._shutdown is not None
        self._shutdown.set()

    # ---------------------------------------------------------- input side
    def _input_thread(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.input_address)
        wake = self.ctx.socket(zmq.PAIR)
        wake.connect(self._wake_address)
        ready = StageReady(self.stage_id, os.getpid(), self.shm_prefix, self.engine.info())
        sock.send_multipart([StageResponseType.READY.value, msgspec.msgpack.encode(ready)])
        decoders = {t: StageMsgpackDecoder(cls, shm=self.attachments) for t, cls in REQUEST_STRUCTS.items()}
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if wake in events:
                    return
                self._handle_frames(sock.recv_multipart(copy=False), decoders)
        except zmq.ContextTerminated:
            return
        finally:
            sock.close(linger=0)
            wake.close(linger=0)

    def _handle_frames(self, frames: list[zmq.Frame], decoders: dict) -> None:
        """Decode one request; a malformed one is answered with ERROR, never fatal."""
        try:
            if len(frames) < 2:
                raise ValueError(f"expected [type, body, *aux] frames, got {len(frames)} frame(s)")
            req_type = StageRequestType(frames[0].bytes)
            msg = decoders[req_type].decode(frames[1:])
        except Exception as exc:  # noqa: BLE001 - hostile input must not kill the stage
            request_id = _guess_request_id(frames)
            logger.warning("stage %d: dropping malformed request (request %s): %s", self.stage_id, request_id, exc)
            self._out_q.put((StageResponseType.ERROR, StageError(
                f"stage {self.stage_id}: malformed request message: {type(exc).__name__}: {exc}",
                request_id, "MalformedMessage")))
            return
        if req_type is StageRequestType.RELEASE:
            if self.pool is not None:
                self.pool.release(msg.segments)
            return
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._dispatch, req_type, msg)
        except RuntimeError:  # loop closed: shutting down
            pass

    def _dispatch(self, req_type: StageRequestType, msg: Any) -> None:
        if req_type is StageRequestType.GENERATE:
            self._add_request(msg)
        elif req_type is StageRequestType.ABORT:
            asyncio.create_task(self._abort(msg))
        elif req_type is StageRequestType.HEALTH_CHECK:
            asyncio.create_task(self._health(msg))
        elif req_type is StageRequestType.UTILITY:
            asyncio.create_task(self._utility(msg))
        elif req_type is StageRequestType.SHUTDOWN:
            assert self._shutdown is not None
            self._shutdown.set()

    # ---------------------------------------------------------- handlers
    def _add_request(self, req: StageGenerateRequest) -> None:
        rid = req.request_id
        if rid in self._requests:
            self._send_error(f"stage {self.stage_id}: request id {rid!r} is already running", rid, "DuplicateRequest")
            return
        task = asyncio.create_task(self._generate(req), name=f"stage{self.stage_id}-{rid}")
        self._requests[rid] = task
        task.add_done_callback(lambda t, rid=rid: self._requests.pop(rid, None) if self._requests.get(rid) is t else None)

    async def _generate(self, req: StageGenerateRequest) -> None:
        put = self._out_q.put
        try:
            async for output in self.engine.generate(req.request_id, req.prompt, req.sampling_params):
                put((_OUTPUT, output))
        except asyncio.CancelledError:
            raise
        except StageEngineError as exc:
            self._send_error(f"stage {self.stage_id}: request {req.request_id!r} failed: {exc}", req.request_id,
                             type(exc).__name__)
            self._fatal(exc)
        except Exception as exc:  # noqa: BLE001 - a request failure is not a stage failure
            logger.info("stage %d: request %s failed", self.stage_id, req.request_id, exc_info=True)
            self._send_error(f"stage {self.stage_id}: request {req.request_id!r} failed: {type(exc).__name__}: {exc}",
                             req.request_id, type(exc).__name__)

    async def _abort(self, msg: StageAbortRequest) -> None:
        for rid in msg.request_ids:
            task = self._requests.pop(rid, None)
            if task is not None:
                task.cancel()
        try:
            await self.engine.abort(msg.request_ids)
        except StageEngineError as exc:
            self._fatal(exc)
        except Exception:  # noqa: BLE001
            logger.exception("stage %d: abort of %s failed", self.stage_id, msg.request_ids)

    async def _health(self, msg: StageHealthCheck) -> None:
        healthy = True
        try:
            await self.engine.check_health()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            logger.warning("stage %d: health check failed: %r", self.stage_id, exc)
            healthy = False
        self._out_q.put((StageResponseType.HEALTH, StageHealth(msg.call_id, healthy, len(self._requests), os.getpid())))

    def shm_stats(self) -> dict[str, int]:
        """The stage's shared-memory pool: segments held, leased, bytes."""
        if self.pool is None:
            return {"leased": 0, "bytes": 0}
        return {"leased": self.pool.num_leased(), "bytes": self.pool.total_bytes}

    async def _utility(self, msg: StageUtilityRequest) -> None:
        result = StageUtilityResult(msg.call_id)
        if msg.method in PROC_UTILITY_METHODS:
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

    # --------------------------------------------------------- output side
    def _output_thread(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(self.output_address)
        encoder = StageMsgpackEncoder(shm_pool=self.pool)
        get, get_nowait = self._out_q.get, self._out_q.get_nowait
        try:
            while True:
                items = [get()]
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


def _guess_request_id(frames: list[Any]) -> str | None:
    """Best effort: the request id of a GENERATE/ABORT body that failed to decode."""
    try:
        body = msgspec.msgpack.decode(frames[1].bytes, ext_hook=lambda code, data: None)
    except Exception:  # noqa: BLE001
        return None
    if isinstance(body, list) and body and isinstance(body[0], str):
        return body[0]
    return None


def run_stage_worker(
    stage_id: int,
    stage_type: str,
    engine_args: dict[str, Any],
    input_address: str,
    output_address: str,
    *,
    shm_prefix: str | None = None,
    runtime: dict[str, Any] | None = None,
    final_output_type: str | None = None,
    parent_pid: int | None = None,
    log_level: str = "INFO",
    log_path: str | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Entry point of a stage process (started with the spawn method).

    Not daemonic (vLLM starts children of its own), so the process ties its
    life to the client with the parent-death signal and its own process group,
    which the client kills as a whole if the stage dies.
    """
    die_with_parent()
    if parent_pid is not None and os.getppid() != parent_pid:
        sys.exit(1)  # the client died before we could watch it
    os.setpgid(0, 0)
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.update(env or {})
    logging.basicConfig(level=log_level, format=f"%(asctime)s stage{stage_id} %(levelname)s %(name)s: %(message)s")
    from omni_engine.engines import build_stage_engine

    exit_code = 1
    try:
        engine = build_stage_engine(stage_type, stage_id, engine_args, runtime or {}, final_output_type)
        proc = StageEngineCoreProc(stage_id, engine, input_address, output_address, shm_prefix)
        exit_code = proc.run()
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - logged for the client to show
        logger.exception("stage %d failed", stage_id)
    finally:
        logging.shutdown()
    sys.exit(exit_code)
