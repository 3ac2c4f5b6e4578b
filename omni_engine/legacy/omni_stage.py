"""``OmniStage``: the client side of one legacy stage (``multiprocessing.Queue``).

vLLM-Omni's pre-refactor API (``attach_queues``, ``init_stage_worker``,
``submit``, ``try_collect``, ``stop_stage_worker``) on top of the same
``BaseStageClient`` bookkeeping as the ZMQ client, so the orchestrator drives
either and a dead stage, a failed request or an abort look the same.
Answers are collected by a ``LegacyOutputHandler`` shared by all stages of a
pipeline (the old ``AsyncOmni._run_output_handler``), woken by the queues'
pipes becoming readable rather than by polling.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import queue
import weakref
from typing import Any

from omni_engine.legacy.queues import StageQueue
from omni_engine.loop_context import cancel_now
from omni_engine.outputs import as_omni_request_output
from omni_engine.legacy.stage_worker import LEGACY_STAGE_MAIN
from omni_engine.stage_engine.base_client import BaseStageClient
from omni_engine.wire.protocol import (
    StageReady,
    StageRequestType,
    StageResponseType,
)
from omni_engine.stage_engine.stage_process import (
    StageProcess,
    StageProcessSpec,
    default_log_dir,
)

logger = logging.getLogger(__name__)


class OmniStage(BaseStageClient):
    """One legacy stage process and its two queues."""

    def __init__(self, stage_id: int, process: StageProcessSpec | None = None, *,
                 output_handler: LegacyOutputHandler | None = None, startup_timeout: float | None = None) -> None:
        super().__init__(stage_id, process, startup_timeout)
        self.in_q: StageQueue | None = None
        self.out_q: StageQueue | None = None
        self._handler = output_handler
        self._finalizer: weakref.finalize | None = None
        self._ready_future: asyncio.Future[StageReady] | None = None

    # ------------------------------------------------- vLLM-Omni's stage API
    def attach_queues(self, in_q: StageQueue, out_q: StageQueue) -> None:
        """The queues this stage's worker reads tasks from and puts answers on."""
        for name, q in (("in_q", in_q), ("out_q", out_q)):
            if not isinstance(q, StageQueue):
                raise TypeError(f"stage {self.stage_id}: {name} must be an omni_engine.legacy.queues.StageQueue "
                                f"(a multiprocessing.Queue whose pipe ends the stage closes), got {type(q).__name__}")
        self.in_q, self.out_q = in_q, out_q

    def init_stage_worker(self) -> None:
        """Spawn the stage process (non-blocking; READY arrives on ``out_q``)."""
        if self.in_q is None:
            self.attach_queues(StageQueue(), StageQueue())
        log_path = default_log_dir() / f"legacy-{multiprocessing.current_process().pid}-s{self.stage_id}.log"
        self.process = StageProcess(self.stage_id, self.process_spec, log_path=log_path,
                                    main=LEGACY_STAGE_MAIN, channels={"in_q": self.in_q, "out_q": self.out_q})
        self.process.start()
        # A program that never shuts down must still exit: at interpreter exit
        # multiprocessing joins this non-daemonic process, so it is killed
        # first (atexit runs this before multiprocessing's own exit handler).
        self._finalizer = weakref.finalize(self, StageProcess.kill_group, self.process)
        atexit.register(self._finalizer)
        # The child has its own copy of the answer pipe's write end now. Ours
        # must go: a stage killed in the middle of writing an answer then
        # gives us EOF instead of a read that blocks the event loop forever.
        self.out_q.close_write_end()
        # Likewise the task pipe's read end: with it closed, tasks for a dead
        # stage fail with EPIPE in the feeder instead of filling the pipe.
        self.in_q.close_read_end()

    def submit(self, task: tuple[StageRequestType, Any]) -> None:
        """Queue one task for the stage (pickled by the queue's feeder thread)."""
        self.in_q.put(task)

    def try_collect(self) -> tuple[StageResponseType, Any] | None:
        """The next answer of the stage, or None if there is none yet."""
        try:
            return self.out_q.get_nowait()
        except queue.Empty:
            return None

    def stop_stage_worker(self) -> None:
        """Kill the stage's process group (its children too) and close the queues."""
        if self.process is not None:
            self.process.kill_group()
        self._close_queues()

    # --------------------------------------------------- BaseStageClient
    async def start(self) -> None:
        """Spawn the stage and wait for its READY."""
        self._loop = asyncio.get_running_loop()
        if self._handler is None:
            self._handler = LegacyOutputHandler()
        self._ready_future = self._loop.create_future()
        if self.process_spec is None:
            raise ValueError(f"stage {self.stage_id}: a legacy stage needs a process spec")
        self.init_stage_worker()
        self._handler.add(self)
        try:
            await self._wait_ready()
        except BaseException:
            await self.shutdown()
            raise
        self._watch_process()

    async def _recv_ready(self) -> StageReady:
        return await self._ready_future

    async def _send(self, req_type: StageRequestType, msg: Any) -> None:
        self.submit((req_type, msg))

    def on_answer(self, item: Any) -> None:
        """One answer collected by the output handler."""
        try:
            rtype, msg = item
            rtype = StageResponseType(rtype)
        except (TypeError, ValueError) as exc:
            logger.warning("stage %d: dropping malformed answer: %s", self.stage_id, exc)
            return
        if rtype is StageResponseType.READY:
            if self._ready_future is not None and not self._ready_future.done():
                self._ready_future.set_result(msg)
            return
        if rtype is StageResponseType.OUTPUT:
            # One output per put (the legacy stage does not batch), as the stage made it.
            self._on_outputs([as_omni_request_output(msg)])
        else:
            self._on_response(rtype, msg)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the stage process and close both queues. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self._stop_process(timeout)
        self._release_now()

    def _release_now(self) -> None:
        if self._handler is not None:
            self._handler.remove(self, self._loop)
        super()._release_now()
        self._close_queues()
        if self._finalizer is not None:
            self._finalizer.detach()

    def _send_nowait(self, req_type: StageRequestType, msg: Any) -> bool:
        self.submit((req_type, msg))
        return True

    def _close_queues(self) -> None:
        for q in (self.in_q, self.out_q):
            if q is not None:
                q.close()
                # Nothing reads them any more: don't let interpreter exit wait on them.
                q.cancel_join_thread()


class LegacyOutputHandler:
    """Collects every stage's answers (vLLM-Omni's ``_run_output_handler``).

    One task for all stages. It sleeps until a queue's pipe is readable (a
    loop reader on the queue's connection: no polling), then drains every
    stage that has something with ``try_collect``.
    """

    def __init__(self) -> None:
        self._stages: dict[int, OmniStage] = {}
        self._readable: set[int] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def add(self, stage: OmniStage) -> None:
        loop = asyncio.get_running_loop()
        fd = stage.out_q.reader_fileno()
        self._stages[fd] = stage
        loop.add_reader(fd, self._on_readable, fd)
        # uvloop (libuv) makes a polled fd non-blocking. multiprocessing reads
        # a message with blocking reads, so one larger than the pipe buffer
        # (a sentence of audio) would fail half-read with BlockingIOError and
        # leave the pipe out of step. Polling for readiness works either way.
        os.set_blocking(fd, True)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run_output_handler(), name="legacy-output-handler")

    def remove(self, stage: OmniStage, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Stop watching ``stage`` (``loop``: the handler's, when called off it)."""
        loop = loop or asyncio.get_running_loop()
        for fd, known in list(self._stages.items()):
            if known is stage:
                if not loop.is_closed():
                    loop.remove_reader(fd)
                del self._stages[fd]
                self._readable.discard(fd)
        if not self._stages and self._task is not None:
            cancel_now([self._task])
            self._task = None

    def _on_readable(self, fd: int) -> None:
        self._readable.add(fd)
        self._wake.set()

    async def _run_output_handler(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            fds, self._readable = self._readable, set()
            for fd in fds:
                stage = self._stages.get(fd)
                if stage is not None:
                    self._drain(stage)

    def _drain(self, stage: OmniStage) -> None:
        while True:
            try:
                item = stage.try_collect()
            except (EOFError, OSError):
                # The stage process is gone (its sentinel reports how); stop watching its pipe.
                self.remove(stage)
                return
            except Exception as exc:  # noqa: BLE001 - an unpicklable answer must not stop the others
                logger.warning("stage %d: dropping an answer that cannot be read: %s: %s",
                               stage.stage_id, type(exc).__name__, exc)
                continue
            if item is None:
                return
            stage.on_answer(item)
