"""The stage's engine side: ``StageEngineCore``, the request handling of a stage.

``StageEngineCore`` runs one engine (a task per streamed request, abort, health,
utility calls, a fatal error ending the stage) and does not depend on how
requests arrive and answers leave: ``StageEngineCoreProc``
(``stage_core_proc``, vLLM's ``EngineCoreProc``) carries them over ZMQ, the
legacy architecture (``omni_engine.legacy``) over ``multiprocessing.Queue``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, ClassVar, Protocol

import uvloop

from omni_engine.engines.base import StageEngine, StageEngineError
from omni_engine.stage_output import StageRequestOutput, aborted_stage_output
from omni_engine.tracing.stage_timing import StageTiming
from omni_engine.wire.protocol import (
    DUPLICATE_REQUEST,
    InputStream,
    StageDead,
    StageError,
    StageGenerateRequest,
    StageHealth,
    StageHealthCheck,
    StageRequestType,
    StageResponseType,
    StageUtilityRequest,
    StageUtilityResult,
)

logger = logging.getLogger(__name__)

_OUTPUT = StageResponseType.OUTPUT
# A traced request's final output and its StageTiming, as one item: the two leave in one message.
TIMED_OUTPUT = object()
# Seconds an aborted request's engine has to end its stream with its own final
# output (vLLM's does at once, with the partial text) before the stage cancels
# it and sends an empty final output itself.
ABORT_GRACE_S = 1.0


class ResponseSink(Protocol):
    """Where answers go: ``put((StageResponseType, payload))``, never blocking (thread-safe where a
    transport's own threads put too)."""

    def put(self, item: Any) -> None: ...


class StageEngineCore:
    """Runs one ``StageEngine`` on a uvloop event loop; subclasses add the transport."""

    # Utility calls the stage process answers itself (not its engine).
    PROC_UTILITY_METHODS: ClassVar[frozenset[str]] = frozenset({"num_unfinished_requests", "loaded_packages"})
    # The process is the stage's: SIGTERM/SIGINT end the stage (when it runs on the main
    # thread), and models write large outputs into its pool. A stage in the client's
    # process leaves the process's signals and globals to the client.
    OWNS_PROCESS: ClassVar[bool] = True

    def __init__(self, stage_id: int, engine: StageEngine, out_q: ResponseSink) -> None:
        self.stage_id = stage_id
        self.engine = engine
        self._out_q = out_q
        self._requests: dict[str, asyncio.Future] = {}  # a task, or a submitted request's future
        # Requests the engine opened (input in parts, states streamed): closed when they end.
        self._opened: set[str] = set()
        # Aborted requests whose streams are ending (their final output still to send).
        self._aborting: dict[str, asyncio.Future] = {}
        # Traced requests (their GENERATE carried trace headers) and what was recorded of them.
        self._traced: dict[str, StageTiming] = {}
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
        self.engine.on_fatal = self._fatal
        self._start_transport()
        if self.OWNS_PROCESS and threading.current_thread() is threading.main_thread():
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

    def loaded_packages(self) -> list[str]:
        """The top-level packages this process has imported, sorted: what a stage costs to start
        shows here (a speech stage that lists ``vllm`` or ``torch`` paid seconds for nothing)."""
        return sorted({name.partition(".")[0] for name in list(sys.modules)})

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
        if req.input_stream >= InputStream.MORE:
            self._extend_request(req)
            return
        if rid in self._requests:
            self._send_error(f"stage {self.stage_id}: GENERATE for request {rid!r} refused: that request id is "
                             "already running", rid, DUPLICATE_REQUEST)
            return
        if req.lora_request is not None:
            if not self.engine.USES_VLLM:
                self._request_failed(rid, ValueError(
                    f"lora_request {getattr(req.lora_request, 'lora_name', req.lora_request)!r}: this stage's "
                    f"engine ({type(self.engine).__name__}) runs no LoRA adapters; an llm stage with "
                    "engine_args.enable_lora does"))
                return
        if req.trace is not None:
            self._trace(req)
        if req.input_stream is InputStream.OPEN or req.stream_states:
            try:  # (an engine that cannot refuses here, by name: nothing has started)
                self.engine.open_request(rid, input_stream=req.input_stream is InputStream.OPEN,
                                         stream_states=req.stream_states)
            except Exception as exc:  # noqa: BLE001 - the request fails, the stage serves on
                self._request_failed(rid, exc)
                return
            self._opened.add(rid)
        if req.lora_request is not None:
            self.engine.lora_requests[rid] = req.lora_request
        aborted_before = self._aborting.get(rid)
        # An engine that answers once takes the request without a task (``StageEngine.submit``);
        # a request whose id is still ending an aborted stream waits for it in a task.
        submitted = self._submit(req) if aborted_before is None else None
        if submitted is not None:
            self._requests[rid] = submitted
            submitted.add_done_callback(functools.partial(self._submitted_done, rid))
            return
        task = asyncio.create_task(self._generate(req, aborted_before), name=f"stage{self.stage_id}-{rid}")
        self._requests[rid] = task
        task.add_done_callback(functools.partial(self._request_done, rid))

    def _extend_request(self, req: StageGenerateRequest) -> None:
        """The next part of a running request's input; one for a request that has ended is dropped
        (a talker that spoke its stop code before the thinker finished needs no more of it)."""
        rid = req.request_id
        if rid not in self._requests or rid not in self._opened:
            return
        try:
            self.engine.extend_input(rid, req.prompt, last=req.input_stream is InputStream.END)
        except Exception as exc:  # noqa: BLE001 - that request fails, naming the part; the stage serves on
            self._requests.pop(rid).cancel()
            self._request_failed(rid, exc)

    def _trace(self, req: StageGenerateRequest) -> None:
        """Record what happens to ``req`` (``StageTiming``), sent with its final output."""
        timing = self._traced[req.request_id] = StageTiming(time.time(), pid=os.getpid())
        self.engine.on_work_started = self._work_started
        if self.engine.USES_VLLM:
            self.engine.trace_headers[req.request_id] = req.trace
        self._on_traced(req.request_id, timing)

    def _on_traced(self, request_id: str, timing: StageTiming) -> None:
        """A request is traced (a transport counts its shared-memory bytes into ``timing``)."""

    def _work_started(self, request_id: str, at: float | None) -> None:
        timing = self._traced.get(request_id)
        if timing is not None and not timing.started:
            timing.started = at if at is not None else time.time()

    def _send_output(self, output: Any) -> None:
        """Queue one output for the client; a traced request's final one goes with its timing."""
        timing = self._traced.get(output.request_id) if self._traced else None
        if timing is None:
            self._out_q.put((_OUTPUT, output))
            return
        now = time.time()
        timing.outputs += 1
        if not timing.first_output:
            timing.first_output = now
        if not output.finished:
            self._out_q.put((_OUTPUT, output))
            return
        timing.finished = now
        del self._traced[output.request_id]
        self._out_q.put((TIMED_OUTPUT, (output, timing)))

    def _submit(self, req: StageGenerateRequest) -> asyncio.Future | None:
        try:
            return self.engine.submit(req.request_id, req.prompt, req.sampling_params, req.deadline)
        except Exception as exc:  # noqa: BLE001 - as if raised by generate(): its future fails
            future = asyncio.get_running_loop().create_future()
            future.set_exception(exc)
            return future

    def _submitted_done(self, rid: str, future: asyncio.Future) -> None:
        """A submitted request ended: send its output, or its abort's, or its error."""
        if future.cancelled():
            if self._aborting.get(rid) is future:
                self._send_output(self._abort_output(rid))
        elif (exc := future.exception()) is not None:
            self._request_failed(rid, exc)
        else:
            self._send_output(future.result())
        self._request_done(rid, future)

    def _request_done(self, rid: str, task: asyncio.Future) -> None:
        if self._requests.get(rid) is task:
            del self._requests[rid]
            if self.engine.lora_requests:  # (not taken: it failed or was aborted before it started)
                self.engine.lora_requests.pop(rid, None)
        if rid in self._opened and rid not in self._requests:
            self._opened.discard(rid)
            self.engine.close_request(rid)
        if self._aborting.get(rid) is task:
            del self._aborting[rid]
        if self._traced and self._requests.get(rid) is None and self._aborting.get(rid) is None:
            # (Failed: no final output took its timing.) A new request with the id may be traced now.
            self._traced.pop(rid, None)
            self.engine.trace_headers.pop(rid, None)
        self._on_request_done(rid)

    def _on_request_done(self, request_id: str) -> None:
        """A request's task ended (finished, failed or aborted); its outputs are queued."""

    async def _generate(self, req: StageGenerateRequest, aborted_before: asyncio.Task | None = None) -> None:
        """Run one request, sending its outputs. Aborted, it still ends with one final output
        (finish_reason "abort", the partial text where the engine has it), as vLLM's AsyncLLM does."""
        if aborted_before is not None:
            # The aborted request with this id sends its final output first.
            await asyncio.wait([aborted_before])
        send = self._send_output
        finished = False
        try:
            async for output in self.engine.generate(req.request_id, req.prompt, req.sampling_params,
                                                     req.deadline):
                send(output)
                finished = output.finished
            if not finished and self._is_aborting(req.request_id):
                send(self._abort_output(req.request_id))
        except asyncio.CancelledError:
            if not finished and self._is_aborting(req.request_id):
                send(self._abort_output(req.request_id))
            raise
        except Exception as exc:  # noqa: BLE001 - a request failure is not a stage failure (but see below)
            self._request_failed(req.request_id, exc)

    def _request_failed(self, request_id: str, exc: BaseException) -> None:
        """ERROR for the request; a ``StageEngineError`` (the engine cannot serve) also ends the stage."""
        if isinstance(exc, StageEngineError):
            self._send_error(f"stage {self.stage_id}: request {request_id!r} failed: {exc}", request_id,
                             type(exc).__name__)
            self._fatal(exc)
            return
        logger.info("stage %d: request %s failed", self.stage_id, request_id, exc_info=exc)
        self._send_error(f"stage {self.stage_id}: request {request_id!r} failed: {type(exc).__name__}: {exc}",
                         request_id, type(exc).__name__)

    def _is_aborting(self, request_id: str) -> bool:
        return self._aborting.get(request_id) is asyncio.current_task()

    def _abort_output(self, request_id: str) -> StageRequestOutput:
        return aborted_stage_output(request_id, self.stage_id, self.engine.output_type)

    async def _abort(self, aborted: dict[str, asyncio.Future]) -> None:
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
