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
import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import weakref
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from omni_engine import envs
from omni_engine.connectors.leases import ShmLeaseBook, lease_book_for
from omni_engine.connectors.shm import (
    ShmAttachments,
    default_attachments,
    new_run_prefix,
    pid_alive,
    remove_stale_segments,
    stage_prefix,
    unlink_prefix,
)
from omni_engine.errors import StageDeadError, StageRequestError, StageStartupError
from omni_engine.outputs import OmniRequestOutput
from omni_engine.stage_engine.protocol import (
    RESPONSE_STRUCTS,
    StageAbortRequest,
    StageGenerateRequest,
    StageHealthCheck,
    StageReady,
    StageReleaseRequest,
    StageRequestType,
    StageResponseType,
    StageShutdown,
    StageUtilityRequest,
)
from omni_engine.stage_engine.stage_process import (
    StageProcess,
    StageProcessSpec,
    default_log_dir,
)
from omni_engine.stage_engine.stage_serialization import (
    StageMsgpackDecoder,
    StageMsgpackEncoder,
)

logger = logging.getLogger(__name__)

StageItem = OmniRequestOutput | StageRequestError


RUNTIME_DIR_PREFIX = "omni-"


def remove_stale_runtime_dirs() -> list[Path]:
    """Remove socket directories of clients that died without cleaning up (kill -9)."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{RUNTIME_DIR_PREFIX}*-s*-*"):
        pid = path.name[len(RUNTIME_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def make_addresses(stage_id: int, transport: str, runtime_dir: Path, host: str = "127.0.0.1") -> tuple[str, str]:
    """Input/output addresses for a stage. ``tcp`` ports are chosen at bind time."""
    if transport == "ipc":
        return f"ipc://{runtime_dir}/in", f"ipc://{runtime_dir}/out"
    if transport == "tcp":
        return f"tcp://{host}:*", f"tcp://{host}:*"
    raise ValueError(f"stage {stage_id}: unknown transport {transport!r}; use 'ipc' or 'tcp'")


class StageEngineCoreClient:
    """Talks to one stage process: submit, stream outputs, abort, health, utility calls.

    With ``process`` given, ``start()`` spawns the stage and waits for its
    READY; without, it waits for an externally started stage to connect.
    """

    def __init__(
        self,
        stage_id: int,
        input_address: str | None = None,
        output_address: str | None = None,
        *,
        process: StageProcessSpec | None = None,
        transport: str = "ipc",
        startup_timeout: float | None = None,
        attachments: ShmAttachments | None = None,
        lease_book: ShmLeaseBook | None = None,
        run_prefix: str | None = None,
    ) -> None:
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"stage {stage_id}: unknown transport {transport!r}; use 'ipc' or 'tcp'")
        self.stage_id = stage_id
        self.transport = transport
        # Addresses default to fresh ones made at start(), in ``runtime_dir``.
        self.input_address = input_address
        self.output_address = output_address
        # A private directory for this stage's socket files (ours and vLLM's
        # own, via VLLM_RPC_BASE_PATH), removed whole at shutdown: even a
        # stage killed with SIGKILL leaves no socket file behind.
        self.runtime_dir: Path | None = None
        self.process_spec = process
        self.startup_timeout = envs.stage_startup_timeout_s() if startup_timeout is None else startup_timeout
        self.run_prefix = run_prefix or new_run_prefix()
        self.shm_prefix = stage_prefix(self.run_prefix, stage_id)
        self.attachments = attachments or default_attachments()
        self._lease_book = lease_book
        # Requests whose shared memory stays leased after the stage finishes
        # them, until end_request(): under an orchestrator a handle may still
        # be on its way to the next stage.
        self._manual_end: set[str] = set()
        self.process: StageProcess | None = None
        self.ready: StageReady | None = None
        self.dead_error: StageDeadError | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._input: zmq.asyncio.Socket | None = None
        self._output: zmq.asyncio.Socket | None = None
        self._identity: bytes | None = None
        self._encoder = StageMsgpackEncoder()
        self._decoders: dict[StageResponseType, StageMsgpackDecoder] = {}
        # Batches not yet taken by a reader. A deque (not an asyncio.Queue)
        # so that an abort can drop what is queued for the aborted requests:
        # their outputs may hold shared-memory slots.
        self._batches: deque[list[StageItem]] = deque()
        self._batch_ready = asyncio.Event()
        self._pending_items: list[Any] = []
        self._requests: set[str] = set()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._output_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self._finalizer: weakref.finalize | None = None
        # Wire traffic, for metrics: frames sent/received plus shared-memory
        # bytes received as handles.
        self.bytes_sent = 0
        self.bytes_received = 0

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind, launch the stage (if configured) and wait for its READY."""
        self._loop = asyncio.get_running_loop()
        remove_stale_segments()
        if self._lease_book is None:
            self._lease_book = lease_book_for(self._loop)
        remove_stale_runtime_dirs()
        self.runtime_dir = Path(tempfile.mkdtemp(prefix=f"{RUNTIME_DIR_PREFIX}{os.getpid()}-s{self.stage_id}-"))
        default_in, default_out = make_addresses(self.stage_id, self.transport, self.runtime_dir)
        self.input_address = self.input_address or default_in
        self.output_address = self.output_address or default_out
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.ROUTER)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(self.input_address)
        self.input_address = self._input.getsockopt_string(zmq.LAST_ENDPOINT)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self.output_address)
        self.output_address = self._output.getsockopt_string(zmq.LAST_ENDPOINT)
        decoder_args = dict(shm=self.attachments, on_shm_view=self._on_shm_view)
        self._decoders = {t: StageMsgpackDecoder(cls, **decoder_args) for t, cls in RESPONSE_STRUCTS.items()}
        self._finalizer = weakref.finalize(self, _cleanup_sync, None, self.runtime_dir, self.shm_prefix, self._ctx)
        atexit.register(self._finalizer)
        try:
            if self.process_spec is not None:
                self._launch()
            await self._wait_ready()
        except BaseException:
            await self.shutdown()
            raise
        self._lease_book.add_producer(self.ready.shm_prefix, self._send_release)
        self._output_task = asyncio.create_task(self._process_outputs(), name=f"stage{self.stage_id}-outputs")
        if self.process is not None:
            self._loop.add_reader(self.process.sentinel, self._on_process_exit)

    def _launch(self) -> None:
        log_path = default_log_dir() / f"{self.shm_prefix}.log"
        spec = self.process_spec
        spec = dataclasses.replace(spec, env={"VLLM_RPC_BASE_PATH": str(self.runtime_dir), **spec.env})
        self.process = StageProcess(
            self.stage_id, spec, self.input_address, self.output_address, self.shm_prefix, log_path
        )
        self.process.start()
        # The finalizer (GC, atexit) kills the stage if shutdown() never runs.
        self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, _cleanup_sync, self.process, self.runtime_dir, self.shm_prefix, self._ctx
        )
        atexit.register(self._finalizer)

    async def _wait_ready(self) -> None:
        exited = self._loop.create_future()
        if self.process is not None:
            self._loop.add_reader(self.process.sentinel, lambda: exited.done() or exited.set_result(None))
        ready_task = asyncio.create_task(self._recv_ready())
        try:
            done, _ = await asyncio.wait({ready_task, exited}, timeout=self.startup_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if self.process is not None:
                self._loop.remove_reader(self.process.sentinel)
            ready_task.cancel()
        if ready_task in done and not ready_task.cancelled() and ready_task.exception() is None:
            self._identity, self.ready = ready_task.result()
            return
        if exited in done:
            self.process.join(1)
            tail = self.process.log_tail()
            detail = (f"last lines of {self.process.log_path}:\n{tail}" if tail else
                      "it wrote no log, so it failed before the stage code ran (a script that starts "
                      "stages needs an `if __name__ == '__main__':` guard: stages are spawned)")
            raise StageStartupError(self.stage_id, f"{self.process.describe_exit()} during startup; {detail}",
                                    self.process.exitcode)
        tail = f"; last lines of {self.process.log_path}:\n{self.process.log_tail()}" if self.process else ""
        raise StageStartupError(self.stage_id, f"stage {self.stage_id} did not become ready within "
                                               f"{self.startup_timeout:.0f} s{tail}")

    async def _recv_ready(self) -> tuple[bytes, StageReady]:
        decoder = msgspec.msgpack.Decoder(StageReady)
        while True:
            frames = await self._input.recv_multipart()
            if len(frames) == 3 and frames[1] == StageResponseType.READY.value:
                try:
                    return frames[0], decoder.decode(frames[2])
                except msgspec.DecodeError as exc:
                    logger.warning("stage %d: malformed READY ignored: %s", self.stage_id, exc)
            else:
                logger.warning("stage %d: unexpected message before READY ignored", self.stage_id)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the stage and release every socket, file and segment. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.process is not None and self._loop is not None:
            self._loop.remove_reader(self.process.sentinel)
        asked = False
        if self._identity is not None and self.dead_error is None and self._input is not None:
            try:
                await self._send(StageRequestType.SHUTDOWN, StageShutdown("client shutdown"))
                asked = True
            except (zmq.ZMQError, StageDeadError):
                pass
        if self.process is not None:
            await asyncio.to_thread(self.process.stop, timeout if asked else 0.0)
            if self.process.exitcode == 0:  # keep the logs of stages that failed
                self.process.log_path.unlink(missing_ok=True)
        if self._output_task is not None:
            self._output_task.cancel()
            await asyncio.gather(self._output_task, return_exceptions=True)
        self._set_dead(StageDeadError(self.stage_id, f"stage {self.stage_id} client is shut down"), notify=False)
        if self.ready is not None and self._lease_book is not None:
            self._lease_book.remove_producer(self.ready.shm_prefix)
        if self._finalizer is not None:
            self._finalizer()
        self.attachments.detach(prefix=self.shm_prefix)

    # ------------------------------------------------------------- requests
    async def submit_request(self, request_id: str, prompt: Any, sampling_params: Any = None, *,
                             end_on_finish: bool = True) -> None:
        """Send a GENERATE; outputs come from ``get_output_async``.

        With ``end_on_finish`` False the request's shared-memory slots stay
        leased after it finishes, until ``end_request``.
        """
        self._check_alive()
        if request_id in self._requests:
            raise ValueError(f"stage {self.stage_id}: request id {request_id!r} is already in flight")
        msg = StageGenerateRequest(request_id, prompt, sampling_params, self._loop.time())
        self._requests.add(request_id)
        if not end_on_finish:
            self._manual_end.add(request_id)
        try:
            await self._send(StageRequestType.GENERATE, msg)
        except BaseException:
            self._requests.discard(request_id)
            self._manual_end.discard(request_id)
            raise

    async def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort in the stage and forget locally; late outputs of these ids are dropped."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self._end_request(rid)
        self._drop_queued(set(ids))
        if self.dead_error is None and ids:
            await self._send(StageRequestType.ABORT, StageAbortRequest(ids))

    @property
    def lease_book(self) -> ShmLeaseBook | None:
        return self._lease_book

    def end_request(self, request_id: str) -> None:
        """The pipeline is done with ``request_id``: free its shared-memory slots."""
        self._manual_end.discard(request_id)
        self._lease_book.end_request(request_id)

    def _end_request(self, request_id: str) -> None:
        self._requests.discard(request_id)
        self._manual_end.discard(request_id)
        self._lease_book.end_request(request_id)

    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    async def get_output_async(self) -> OmniRequestOutput:
        """The next output of any request; raises ``StageRequestError`` for a failed
        request and ``StageDeadError`` once the stage is dead."""
        while not self._pending_items:
            self._pending_items = await self.get_outputs_async()
            self._pending_items.reverse()
        item = self._pending_items.pop()
        if isinstance(item, StageRequestError):
            raise item
        return item

    async def get_outputs_async(self) -> list[StageItem]:
        """The next batch, outputs and per-request errors in stage order."""
        while not self._batches:
            if self.dead_error is not None:
                raise self.dead_error
            self._batch_ready.clear()
            await self._batch_ready.wait()
        return self._batches.popleft()

    def _put_batch(self, items: list[StageItem]) -> None:
        self._batches.append(items)
        self._batch_ready.set()

    def _drop_queued(self, request_ids: set[str]) -> None:
        """Forget queued outputs of ``request_ids`` (aborted: nobody will read them)."""
        kept = deque()
        for batch in self._batches:
            batch = [item for item in batch if item.request_id not in request_ids]
            if batch:
                kept.append(batch)
        self._batches = kept
        self._pending_items = [item for item in self._pending_items if item.request_id not in request_ids]

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

    # ------------------------------------------------------------ internals
    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._identity is None:
            raise RuntimeError(f"stage {self.stage_id} client is not started")

    async def _send(self, req_type: StageRequestType, msg: Any) -> None:
        bufs = self._encoder.encode(msg)
        self.bytes_sent += sum(memoryview(b).nbytes for b in bufs)
        try:
            await self._input.send_multipart([self._identity, req_type.value, *bufs], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise self._set_dead(StageDeadError(
                    self.stage_id, f"stage {self.stage_id} is unreachable (disconnected)"),
                    notify=not self._stopped) from None
            raise

    def _on_shm_view(self, name: str, owner: str | None, view: memoryview) -> None:
        self.bytes_received += view.nbytes
        self._lease_book.on_view(name, owner, view)

    def _send_release(self, names: list[str]) -> None:
        if self.dead_error is None and self._identity is not None and not self._stopped:
            task = asyncio.ensure_future(self._send(StageRequestType.RELEASE, StageReleaseRequest(names)))
            # A stage that went away meanwhile frees its pool itself.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _process_outputs(self) -> None:
        """Read the PULL socket until cancelled; one batch per message."""
        while True:
            frames = await self._output.recv_multipart(copy=False)
            self.bytes_received += sum(len(f) for f in frames)
            try:
                self._handle_response(frames)
            except Exception as exc:  # noqa: BLE001 - a bad message must not stop the reader
                logger.warning("stage %d: dropping malformed response: %s", self.stage_id, exc)

    def _handle_response(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            raise ValueError(f"expected [type, body, *aux], got {len(frames)} frame(s)")
        rtype = StageResponseType(frames[0].bytes)
        msg = self._decoders[rtype].decode(frames[1:])
        if rtype is StageResponseType.OUTPUT:
            self._on_outputs(msg.outputs)
        elif rtype is StageResponseType.ERROR:
            self._on_error(msg)
        elif rtype in (StageResponseType.HEALTH, StageResponseType.UTILITY_RESULT):
            future = self._calls.get(msg.call_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif rtype is StageResponseType.DEAD:
            self._set_dead(StageDeadError(self.stage_id, f"stage {self.stage_id} reported a fatal error: "
                                                         f"{msg.message}"))

    def _on_outputs(self, outputs: list[Any]) -> None:
        items = []
        for output in outputs:
            if not isinstance(output, OmniRequestOutput) or output.request_id not in self._requests:
                continue  # aborted, or not ours
            if output.finished:
                self._requests.discard(output.request_id)
                if output.request_id not in self._manual_end:
                    self._lease_book.end_request(output.request_id)
            items.append(output)
        if items:
            self._put_batch(items)

    def _on_error(self, msg: Any) -> None:
        if msg.request_id is not None and msg.request_id not in self._requests:
            return
        if msg.request_id is None:
            logger.warning("stage %d reported: %s", self.stage_id, msg.message)
            return
        self._end_request(msg.request_id)
        self._put_batch([StageRequestError(self.stage_id, msg.request_id, msg.message, msg.error_type)])

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
        self._batch_ready.set()  # waiters see dead_error once the queue is drained
        if self.ready is not None:
            self._lease_book.remove_producer(self.ready.shm_prefix)
            self.attachments.detach(prefix=self.ready.shm_prefix)
            unlink_prefix(self.ready.shm_prefix)
        return error

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None


def _cleanup_sync(process: StageProcess | None, runtime_dir: Path, shm_prefix: str,
                  ctx: zmq.asyncio.Context | None) -> None:
    """Last-resort cleanup (shutdown, GC or interpreter exit): nothing of ours survives."""
    if process is not None:
        process.kill_group()
    shutil.rmtree(runtime_dir, ignore_errors=True)
    unlink_prefix(shm_prefix)
    if ctx is not None:
        ctx.destroy(linger=0)
