"""``BaseStageClient``: the transport-independent half of a stage client.

Request bookkeeping (which requests are in flight, their queued outputs,
abort dropping what is queued), calls that wait for an answer (health,
utility), startup against the process sentinel, and death (every waiter
fails at once, naming the stage) do not depend on how messages travel.
``StageEngineCoreClient`` carries them over ZMQ; the legacy architecture's
``OmniStage`` over ``multiprocessing.Queue``. The orchestrator talks to
either through this interface, so both fail the same way. What a transport
holds per request beyond this bookkeeping (the ZMQ transport's shared-memory
slots) it brings as a ``RequestResources``; this class only says when a
request starts and ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from omni_engine import envs
from omni_engine.errors import StageDeadError, StageRequestError
from omni_engine.outputs import OmniRequestOutput
from omni_engine.tracing.stage_timing import StageTiming
from omni_engine.wire.protocol import (
    DUPLICATE_REQUEST,
    InputStream,
    StageAbortRequest,
    StageGenerateRequest,
    StageHealthCheck,
    StageReady,
    StageRequestType,
    StageResponseType,
    StageShutdown,
    StageUtilityRequest,
)
from omni_engine.stage_engine.stage_client import ReplicaStatus, StageItem
from omni_engine.stage_engine.stage_process import StageProcess, StageProcessSpec
from omni_engine.stage_engine.stage_startup import wait_ready

logger = logging.getLogger(__name__)


class RequestResources(Protocol):
    """What a transport holds for a request until the pipeline is done with it."""

    def begin(self, request_id: str) -> None:
        """A request starts: what is taken for it from now on waits for its end."""

    def end(self, request_id: str, open_: bool = False) -> None:
        """The request ended (and the pipeline is done with it): free what it held. ``open_``:
        the stage has not sent its final output (aborted, failed): outputs may still come."""

    def close(self) -> None:
        """The stage is gone: free everything held for it."""


class NoRequestResources:
    """For transports that hold nothing per request (the legacy queues)."""

    def begin(self, request_id: str) -> None:
        pass

    def end(self, request_id: str, open_: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


class StageOutputQueue:
    """A stage's output batches that no reader has taken yet, in arrival order.

    A deque, not an ``asyncio.Queue``, so that an abort can drop what is queued
    for the aborted requests: their outputs may hold shared-memory slots. Shared
    by a stage client and a replica set (which merges its replicas' batches).
    Readers wait on an event, never poll.
    """

    def __init__(self) -> None:
        self._batches: deque[list[Any]] = deque()
        self._ready = asyncio.Event()
        self._pending: list[Any] = []  # the rest of a batch ``get_one`` started

    def put(self, items: list[Any]) -> None:
        self._batches.append(items)
        self._ready.set()

    def wake(self) -> None:
        """Wake the readers (to look at ``dead`` once the queue is drained)."""
        self._ready.set()

    async def get_batch(self, dead: Callable[[], BaseException | None]) -> list[Any]:
        """The next batch; raises ``dead()`` once it is not None and the queue is drained."""
        while not self._batches:
            error = dead()
            if error is not None:
                raise error
            self._ready.clear()
            await self._ready.wait()
        return self._batches.popleft()

    async def get_one(self, dead: Callable[[], BaseException | None]) -> Any:
        """The next item of any batch; an item that is an exception (a request's error) is raised."""
        while not self._pending:
            self._pending = await self.get_batch(dead)
            self._pending.reverse()
        item = self._pending.pop()
        if isinstance(item, BaseException):
            raise item
        return item

    def drop(self, request_ids: set[str]) -> None:
        """Forget queued items of ``request_ids`` (aborted: nobody will read them)."""
        kept: deque[list[Any]] = deque()
        for batch in self._batches:
            batch = [item for item in batch if item.request_id not in request_ids]
            if batch:
                kept.append(batch)
        self._batches = kept
        self._pending = [item for item in self._pending if item.request_id not in request_ids]

    def __len__(self) -> int:
        """Items queued."""
        return sum(len(batch) for batch in self._batches) + len(self._pending)


class BaseStageClient:
    """A ``StageClient`` of one stage process (one replica).

    Subclasses provide ``_send`` (one request out), ``_recv_ready`` (the
    stage's READY, however it arrives), ``start`` and ``shutdown``, and feed
    decoded answers to ``_on_response``.
    """

    resubmitted = 0  # one replica: nowhere to move a request to

    def __init__(self, stage_id: int, process: StageProcessSpec | None = None,
                 startup_timeout: float | None = None, resources: RequestResources | None = None) -> None:
        self.stage_id = stage_id
        self.resources: RequestResources = resources or NoRequestResources()
        self.process_spec = process
        self.startup_timeout = envs.stage_startup_timeout_s() if startup_timeout is None else startup_timeout
        self.process: StageProcess | None = None
        self.ready: StageReady | None = None
        self.dead_error: StageDeadError | None = None
        self._outputs = StageOutputQueue()
        self._requests: set[str] = set()
        # Requests whose resources stay held after the stage finishes them,
        # until end_request(): under an orchestrator a shared-memory handle
        # may still be on its way to the next stage.
        self._manual_end: set[str] = set()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self._asked_stop = False  # a synchronous shutdown sent SHUTDOWN
        # Told when the stage dies unexpectedly (not at shutdown): e.g. the
        # pipeline's restart policy.
        self.on_dead: Callable[[StageDeadError], None] | None = None
        # Where batches go instead of this client's own queue: a replica set's merged one.
        self.sink: Callable[[list[StageItem]], None] | None = None
        self.submitted = 0  # requests sent (ReplicaStatus.submitted)
        # Wire traffic, for metrics (transports that cannot count leave 0).
        self.bytes_sent = 0
        self.bytes_received = 0

    # ------------------------------------------------------------ transport
    async def _send(self, req_type: StageRequestType, msg: Any) -> None:
        raise NotImplementedError

    async def _recv_ready(self) -> StageReady:
        """The stage's READY (the only thing it sends before it serves)."""
        raise NotImplementedError

    # ------------------------------------------------------------- requests
    async def submit_request(self, request_id: str, prompt: Any, sampling_params: Any = None, *,
                             end_on_finish: bool = True, group: str | None = None,
                             trace: dict[str, str] | None = None, deadline: float | None = None,
                             input_stream: bool = False, stream_states: bool = False,
                             lora_request: Any = None) -> None:
        """Send a GENERATE; outputs come from ``get_output_async``.

        With ``end_on_finish`` False what the transport holds for the request
        (shared-memory slots of its outputs) stays held after it finishes,
        until ``end_request``: under an orchestrator a handle may still be on
        its way to the next stage. ``group`` names the request a sub-request
        belongs to (a replica set keeps a group on one replica; one client has
        nothing to choose). ``trace``: the W3C headers of the request's span in this
        stage; its final output then carries the stage's ``stage_timing``. ``deadline``: when
        the output is needed (``time.time()`` seconds); the stage serves earliest first.
        ``input_stream``: more of the request's input follows (``extend_request``).
        ``stream_states``: its partial outputs carry the states written since the last one.
        ``lora_request``: vLLM's LoRARequest the request runs with (an llm stage with ``enable_lora``).
        """
        self._check_alive()
        if request_id in self._requests:
            raise ValueError(f"stage {self.stage_id}: request id {request_id!r} is already in flight")
        msg = StageGenerateRequest(request_id, prompt, sampling_params, self._loop.time(), trace, deadline,
                                   InputStream.OPEN if input_stream else InputStream.NONE, stream_states,
                                   lora_request)
        self._requests.add(request_id)
        self.submitted += 1
        self.resources.begin(request_id)
        if not end_on_finish:
            self._manual_end.add(request_id)
        try:
            await self._send(StageRequestType.GENERATE, msg)
        except BaseException:
            self._requests.discard(request_id)
            self._manual_end.discard(request_id)
            raise

    async def extend_request(self, request_id: str, prompt: Any, *, last: bool) -> bool:
        """Append ``prompt`` to the input of a request submitted with ``input_stream``; ``last``: its
        input ends there. False (nothing sent) where the request has ended here."""
        self._check_alive()
        if request_id not in self._requests:
            return False
        await self._send(StageRequestType.GENERATE, StageGenerateRequest(
            request_id, prompt, input_stream=InputStream.END if last else InputStream.MORE))
        return True

    async def abort_request(self, request_ids: str | Sequence[str], *, keep_final: bool = False) -> None:
        """Abort in the stage. The stage ends each aborted request with a final output
        (``finish_reason="abort"``); with ``keep_final`` it is delivered like any output and
        ends the request here, else the ids are forgotten now and their late outputs dropped."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if keep_final:
            ids = [rid for rid in ids if rid in self._requests]
        else:
            for rid in ids:
                self._end_request(rid)
            self._drop_queued(set(ids))
        if self.dead_error is None and ids:
            await self._send(StageRequestType.ABORT, StageAbortRequest(ids, final_outputs=keep_final))

    def end_request(self, request_id: str) -> None:
        """The pipeline is done with ``request_id``: free what the transport holds for it."""
        self._manual_end.discard(request_id)
        self.resources.end(request_id, request_id in self._requests)

    def _end_request(self, request_id: str) -> None:
        open_ = request_id in self._requests
        self._requests.discard(request_id)
        self._manual_end.discard(request_id)
        self.resources.end(request_id, open_)

    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    @property
    def replicas(self) -> list[BaseStageClient]:
        """One replica: this client."""
        return [self]

    def replica_status(self) -> list[ReplicaStatus]:
        ready = self.ready
        return [ReplicaStatus(not self.is_dead, len(self._requests), self.submitted,
                              ready.pid if ready is not None else None, ready.host_id if ready is not None else None)]

    def state_counts(self) -> dict[str, int]:
        """What this client still holds per request: all zero once the pipeline is idle.

        ``in_flight``: submitted, not finished; ``held``: finished, shared
        memory kept until ``end_request``; ``queued``: outputs no reader took.
        """
        return {"in_flight": len(self._requests), "held": len(self._manual_end), "queued": len(self._outputs)}

    async def get_output_async(self) -> OmniRequestOutput:
        """The next output of any request; raises ``StageRequestError`` for a failed
        request and ``StageDeadError`` once the stage is dead."""
        return await self._outputs.get_one(lambda: self.dead_error)

    async def get_outputs_async(self) -> list[StageItem]:
        """The next batch, outputs and per-request errors in stage order."""
        return await self._outputs.get_batch(lambda: self.dead_error)

    def _put_batch(self, items: list[StageItem]) -> None:
        if self.sink is not None:
            self.sink(items)
        else:
            self._outputs.put(items)

    def _drop_queued(self, request_ids: set[str]) -> None:
        self._outputs.drop(request_ids)

    # -------------------------------------------------------- health, utility
    async def check_health(self, timeout: float = 10.0) -> None:
        """Raise ``StageDeadError`` unless the stage answers healthy within ``timeout``."""
        call_id = next(self._call_ids)
        health = await self._call(StageRequestType.HEALTH_CHECK, StageHealthCheck(call_id), call_id, timeout)
        if not health.healthy:
            raise StageDeadError(self.stage_id, f"stage {self.stage_id} reports unhealthy")

    async def call_utility_async(self, utility: str, /, *args: Any, call_timeout: float | None = None,
                                 **kwargs: Any) -> Any:
        """Call an engine method in the stage (pause_generation, collective_rpc, ...).

        ``kwargs`` go to the method (vLLM's collective_rpc takes ``method`` and
        ``timeout`` itself); ``call_timeout`` bounds the wait for the answer.
        """
        call_id = next(self._call_ids)
        msg = StageUtilityRequest(call_id, utility, list(args), kwargs)
        result = await self._call(StageRequestType.UTILITY, msg, call_id, call_timeout)
        if result.error is not None:
            raise RuntimeError(result.error)
        return result.result

    async def call_each_replica_async(self, utility: str, /, *args: Any, call_timeout: float | None = None,
                                      return_exceptions: bool = False, **kwargs: Any) -> dict[int, Any]:
        """``call_utility_async`` per replica (replica index -> result); one client is replica 0."""
        try:
            return {0: await self.call_utility_async(utility, *args, call_timeout=call_timeout, **kwargs)}
        except Exception as exc:
            if not return_exceptions:
                raise
            return {0: exc}

    async def _call(self, req_type: StageRequestType, msg: Any, call_id: int, timeout: float | None) -> Any:
        self._check_alive()
        future = self._loop.create_future()
        self._calls[call_id] = future
        try:
            await self._send(req_type, msg)
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise StageDeadError(self.stage_id, f"stage {self.stage_id} did not answer {req_type.name} "
                                                f"within {timeout} s") from None
        finally:
            self._calls.pop(call_id, None)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self.ready is None:
            raise RuntimeError(f"stage {self.stage_id} client is not started")

    # ------------------------------------------------------------- answers
    def _on_response(self, rtype: StageResponseType, msg: Any) -> None:
        """One decoded answer from the stage."""
        if rtype is StageResponseType.OUTPUT:
            self._on_outputs(msg.outputs, msg.timings)
        elif rtype is StageResponseType.ERROR:
            self._on_error(msg)
        elif rtype in (StageResponseType.HEALTH, StageResponseType.UTILITY_RESULT):
            future = self._calls.get(msg.call_id)
            if future is None or future.done():
                logger.info("stage %d: %s for call %d dropped: no call waits for it (timed out?)",
                            self.stage_id, rtype.name, msg.call_id)
            else:
                future.set_result(msg)
        elif rtype is StageResponseType.DEAD:
            # While we stop the stage (SIGTERM after a SHUTDOWN timed out) its DEAD is expected.
            self._set_dead(StageDeadError(self.stage_id, f"stage {self.stage_id} reported a fatal error: "
                                                         f"{msg.message}"), notify=not self._stopped)
        elif rtype is StageResponseType.HEARTBEAT:
            pass  # its arrival is what counts (StageEngineCoreClient._take_response)
        else:  # READY belongs on the request socket, once
            logger.warning("stage %d: unexpected %s on the output socket dropped", self.stage_id, rtype.name)

    def _on_outputs(self, outputs: list[Any], timings: dict[str, StageTiming] | None = None) -> None:
        items = []
        for output in outputs:
            if not isinstance(output, OmniRequestOutput) or output.request_id not in self._requests:
                continue  # aborted, or not ours
            if output.finished:
                if timings:
                    output.stage_timing = timings.get(output.request_id)
                self._requests.discard(output.request_id)
                if output.request_id not in self._manual_end:
                    self.resources.end(output.request_id)
            items.append(output)
        if items:
            self._put_batch(items)

    def _on_error(self, msg: Any) -> None:
        if msg.request_id is None:
            logger.warning("stage %d reported: %s", self.stage_id, msg.message)
            return
        if msg.request_id not in self._requests:
            logger.debug("stage %d: error for a request not in flight dropped: %s", self.stage_id, msg.message)
            return
        if msg.error_type == DUPLICATE_REQUEST:
            # We never send a second GENERATE for an id in flight (submit_request
            # refuses it), so this one came from elsewhere; ours runs on.
            logger.warning("stage %d: %s", self.stage_id, msg.message)
            return
        self._end_request(msg.request_id)
        self._put_batch([StageRequestError(self.stage_id, msg.request_id, msg.message, msg.error_type)])

    # ------------------------------------------------------ startup, death
    async def _wait_ready(self, hint: str = "") -> None:
        """Wait for READY, failing fast (with the log's tail) if the process dies first."""
        self.ready = await wait_ready(self.stage_id, self.process, self.startup_timeout, self._recv_ready(), hint)

    def _watch_process(self) -> None:
        if self.process is not None:
            self._loop.add_reader(self.process.sentinel, self._on_process_exit)

    def _on_process_exit(self) -> None:
        process = self.process
        self._loop.remove_reader(process.sentinel)
        process.join(0.5)
        # Reap what the stage started (vLLM's EngineCore) before anyone retries.
        process.kill_group()
        tail = process.log_tail(15)
        self._set_dead(StageDeadError(
            self.stage_id, f"{process.describe_exit()}" + (f"; last log lines:\n{tail}" if tail else ""),
            process.exitcode))

    async def _stop_process(self, timeout: float) -> None:
        """Ask the stage to exit (SHUTDOWN), then stop its process group; keep logs of failed stages."""
        self._forget_process()
        asked = False
        if self.ready is not None and self.dead_error is None:
            try:
                await self._send(StageRequestType.SHUTDOWN, StageShutdown("client shutdown"))
                asked = True
            except Exception:  # noqa: BLE001 - the stage may be gone already; stopped below
                logger.debug("stage %d: SHUTDOWN not sent", self.stage_id, exc_info=True)
        await self._reap(timeout if asked else 0.0)

    async def _reap(self, grace: float) -> None:
        """``_reap_process`` without blocking the loop."""
        await asyncio.to_thread(self._reap_process, grace)

    def _forget_process(self) -> None:
        """Stop watching the process's exit: from here on it is stopped on purpose."""
        process = self.process
        if process is not None and process.pid is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(process.sentinel)  # (none to remove if it never started)

    def _reap_process(self, grace: float) -> None:
        """Blocking: ``grace`` for a requested exit, then SIGTERM and SIGKILL of the process group;
        the log of a stage that exited cleanly goes, a failed one's stays."""
        process = self.process
        if process is not None:
            process.stop(grace)
            if process.exitcode == 0:
                process.discard_log()

    def _send_nowait(self, req_type: StageRequestType, msg: Any) -> bool:
        """Send without the event loop (a synchronous shutdown); False if it could not be sent."""
        return False

    def shutdown_now(self, timeout: float = 10.0) -> None:
        """``shutdown`` without awaiting, for a synchronous shutdown on the loop's thread or
        after the loop stopped (see ``omni_engine.loop_context``). Idempotent."""
        if self.ask_stop_now():
            self.finish_shutdown_now(timeout)

    def ask_stop_now(self) -> bool:
        """First half of ``shutdown_now``: stop watching the process and send SHUTDOWN if it can
        go at once (not awaited). False if this client was stopping already. A pipeline asks all
        its stages first, so they exit together."""
        if self._stopped:
            return False
        self._stopped = True
        self._forget_process()
        self._asked_stop = False
        if self.ready is not None and self.dead_error is None:
            try:
                self._asked_stop = self._send_nowait(StageRequestType.SHUTDOWN, StageShutdown("client shutdown"))
            except Exception:  # noqa: BLE001 - stopped below either way
                logger.debug("stage %d: SHUTDOWN not sent", self.stage_id, exc_info=True)
        return True

    def finish_shutdown_now(self, timeout: float) -> None:
        """Second half: the process gets ``timeout`` to exit (if asked), then SIGTERM and SIGKILL of
        its group; then everything else the client holds is freed (``_release_now``)."""
        self._reap_process(timeout if self._asked_stop else 0.0)
        self._release_now()

    def _release_now(self) -> None:
        """Free the transport, tasks and request state without awaiting (after the process stopped;
        the end of ``shutdown`` too)."""
        self._set_dead_now(StageDeadError(self.stage_id, f"stage {self.stage_id} client is shut down"))

    def _set_dead_now(self, error: StageDeadError) -> None:
        """``_set_dead`` where the loop may be closed: waking a waiter there raises, and nobody waits any more."""
        try:
            self._set_dead(error, notify=False)
        except RuntimeError:  # the loop is closed
            self.dead_error = error
            self._requests.clear()
            self._manual_end.clear()
            self.resources.close()

    def _set_dead(self, error: StageDeadError, notify: bool = True) -> StageDeadError:
        """Fail everything waiting on this stage and free what it held. Idempotent."""
        if self.dead_error is not None:
            return self.dead_error
        self.dead_error = error
        if notify:
            logger.error("%s", error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._requests.clear()
        self._manual_end.clear()
        self._outputs.wake()  # readers see dead_error once the queue is drained
        self.resources.close()
        if notify and self.on_dead is not None:
            self.on_dead(error)
        return error

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None
