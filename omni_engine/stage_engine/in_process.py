"""A stage in the client's process (``runtime.process: false``).

The same stage core, framing and sockets as a stage process, over
``inproc://`` in the client's ZMQ context, so the orchestrator, the replica
set and the wire protocol do not change, and a round trip skips the kernel.
The stage's transport runs on its engine's event loop (no input and output
threads). Where that loop is (``runtime.event_loop``):

* ``own`` (``InProcessStageClient``): a uvloop of its own in a thread of its
  own. A model that blocks stalls only its stage. Each message crosses from
  one thread to the other, which costs a wake-up of the other CPU (and of the
  GIL's holder) per direction.
* ``client`` (``ClientLoopStageClient``): the client's own event loop, as
  vLLM's server runs ``AsyncLLM``. No thread to wake: on these machines a
  round trip takes about a quarter of a stage process's. The model must not
  block the loop (async, or its work in threads, as the speech model does);
  a model step that does is named in a warning (``engines/loop_holds.py``).

What a thread cannot have, validation refuses: an environment or devices of
its own, a restart (a thread cannot be killed), replicas, CURVE (nothing
outside the process can reach an ``inproc`` socket). Tensors travel as ZMQ
frames, which within a process are not copied; shared memory would add nothing.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import weakref
from typing import Any

import msgspec
import zmq

from omni_engine.errors import StageDeadError, StageStartupError
from omni_engine.loop_context import LoopContext, cancel_now, loop_context, own_tasks, running_loop
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.stage_engine.stage_core_proc import StageEngineCoreProc
from omni_engine.stage_engine.stage_process import cleanup_stage
from omni_engine.stage_engine.stage_spec import StageProcessSpec
from omni_engine.wire.protocol import StageReady

logger = logging.getLogger(__name__)

# How long shutdown waits for a stage that was not asked to stop (it died), or that did not
# end in its grace period and was cancelled, to end.
_DEAD_STAGE_WAIT_S = 5.0


class StageEngineCoreInProc(StageEngineCoreProc):
    """The stage core of a stage process, in the client's process: its signals and globals are
    the client's, and it can be stopped, or its sockets closed, from the client's side."""

    OWNS_PROCESS = False

    async def _stop_transport(self) -> None:
        self._out_q.flush()  # what is left (a DEAD above all)
        self.close_now(linger=None)  # (each socket's own: what is sent still reaches the client)

    def request_stop(self) -> None:
        """What SHUTDOWN does, from the loop's thread without a message: the stage winds down
        when its loop next runs."""
        if self._shutdown is not None and not self._shutdown.is_set():
            try:
                self._shutdown.set()
            except RuntimeError:  # its loop is closed: it will never run again
                pass

    def _abandon_transport(self) -> None:
        self.close_now()

    def close_now(self, linger: int | None = 0) -> None:
        """Close the transport without the loop (idempotent): the client's context can only end
        once these sockets are closed, and a stage on a loop that no longer runs cannot close them."""
        self._close_sockets(linger)


class InProcessStageClient(StageEngineCoreClient):
    """A stage client whose stage runs in a thread here instead of in a process of its own."""

    def __init__(self, stage_id: int, spec: StageProcessSpec, startup_timeout: float | None = None) -> None:
        spec = spec.replace(connectors=msgspec.structs.replace(spec.connectors, use_shm=False))
        super().__init__(stage_id, process=spec, transport="inproc", startup_timeout=startup_timeout)
        self.thread: threading.Thread | None = None
        self.exit_code: int | None = None
        self.failure: BaseException | None = None  # what ended the stage, if it raised
        self._exited: asyncio.Future | None = None

    @property
    def stage_running(self) -> bool:
        """Whether the stage still runs (its thread, or its task on the client's loop)."""
        return self.thread is not None and self.thread.is_alive()

    def _new_core(self) -> StageEngineCoreInProc:
        from omni_engine.engines import build_stage_engine

        spec = self.process_spec.replace(stage_id=self.stage_id)
        ctx = zmq.Context.shadow(self._ctx.underlying)  # inproc: both ends in one context
        return StageEngineCoreInProc(spec.stage_id, build_stage_engine(spec), self.input_address,
                                     self.output_address, self.shm_prefix, connectors=spec.connectors, ctx=ctx)

    async def _launch(self) -> None:
        loop = self._loop
        self._exited = loop.create_future()

        def run() -> None:
            code = 1
            try:
                code = self._new_core().run()
            except BaseException as exc:  # noqa: BLE001 - the client hears of it as the stage's death
                self.failure = exc
                logger.exception("stage %d (in-process) failed", self.stage_id)
            finally:
                self.exit_code = code
                try:
                    loop.call_soon_threadsafe(self._on_stage_exit)
                except RuntimeError:  # the client's loop is closed: nobody to tell
                    pass

        self.thread = threading.Thread(target=run, name=f"stage{self.stage_id}-in-process", daemon=True)
        self.thread.start()

    def _exit_reason(self) -> str:
        if self.failure is not None:
            return f"{type(self.failure).__name__}: {self.failure}"
        return f"exit code {self.exit_code}"

    async def _recv_ready(self) -> StageReady:
        """READY, or the stage's own error if it ends first (no process sentinel tells)."""
        ready = asyncio.ensure_future(super()._recv_ready())
        try:
            await asyncio.wait({ready, self._exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not ready.done():
                ready.cancel()
        if not self._exited.done():
            return ready.result()
        raise StageStartupError(self.stage_id, f"stage {self.stage_id} (in-process) ended during startup: "
                                               f"{self._exit_reason()}", self.exit_code)

    def _on_stage_exit(self) -> None:
        if self._loop.is_closed():  # (collected after the loop closed: nothing to tell, nobody to wake)
            return
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(self.exit_code)
        if self._stopped or self.ready is None:  # (during startup, start() fails with the reason)
            return
        # The stage sent everything before it ended (its ERRORs, its DEAD), but this callback
        # may come before the output reader has read them: read them first, so that they, not
        # the bare exit, say what happened.
        sock = zmq.Socket.shadow(self._output.underlying)
        while self.dead_error is None:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._take_response(frames)
        if self.dead_error is None:
            # Cancelled without a shutdown: its loop is ending (asyncio.run's cancellation of
            # what is left), which is no failure to report.
            cancelled = isinstance(self.failure, asyncio.CancelledError)
            self._set_dead(StageDeadError(self.stage_id, f"stage {self.stage_id} (in-process) ended: "
                                                         f"{self._exit_reason()}", self.exit_code),
                           notify=not cancelled)

    def _reap_process(self, grace: float) -> None:
        """Blocking: wait for the stage thread (asked to stop, or ending after a fatal error)."""
        thread = self.thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(grace if grace > 0 else _DEAD_STAGE_WAIT_S)
        if thread.is_alive():
            logger.warning("stage %d (in-process): its thread did not end; it is left to exit with the process",
                           self.stage_id)


class ClientLoopStageClient(InProcessStageClient):
    """A stage client whose stage runs on this client's event loop (``event_loop: client``).

    The stage is a task here; stopping it is a wait for that task. A synchronous shutdown
    from another thread while the loop runs waits for it there. Where the loop cannot run
    meanwhile (the shutdown is on its thread, or it stopped), the stage's sockets are closed
    at once and its engine's teardown is left to the loop's next turns (``asyncio.run`` gives
    its remaining tasks those), except that on the loop's own thread, between two runs of
    it, the loop is run until the stage has ended. After the loop closed, nothing of the
    stage can run any more: only its sockets are freed.
    """

    def __init__(self, stage_id: int, spec: StageProcessSpec, startup_timeout: float | None = None) -> None:
        super().__init__(stage_id, spec, startup_timeout)
        self.core: StageEngineCoreInProc | None = None
        self.task: asyncio.Task | None = None
        self._ended = threading.Event()  # the task's end, for a waiter on another thread
        self._loop_thread: int | None = None  # the thread that runs the loop (and the stage)
        self.loop_holds: Any = None  # the engine's LoopHoldReport, once launched

    @property
    def stage_running(self) -> bool:
        return self.task is not None and not self.task.done()

    async def _launch(self) -> None:
        self._exited = self._loop.create_future()
        self._loop_thread = threading.get_ident()
        self.core = core = self._new_core()
        # The loop is everyone's here: a model step that holds it is named in a warning.
        self.loop_holds = core.engine.watch_loop_holds()
        # A stage whose shutdown never runs (GC, interpreter exit) has no loop left to close
        # its sockets, and the context cannot end while they are open.
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _cleanup_loop_stage, core, self.runtime_dir, self.shm_prefix,
                                           self._ctx)
        atexit.register(self._finalizer)
        self.task = self._loop.create_task(self._serve(core), name=f"stage{self.stage_id}-on-client-loop")

    async def _serve(self, core: StageEngineCoreInProc) -> None:
        code = 1
        try:
            code = await core.serve()
        except asyncio.CancelledError:
            self.failure = asyncio.CancelledError("cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - the client hears of it as the stage's death
            self.failure = exc
            logger.exception("stage %d (on the client's loop) failed", self.stage_id)
        finally:
            self.exit_code = code
            self._ended.set()
            self._on_stage_exit()

    async def _reap(self, grace: float) -> None:
        task = self.task
        if task is None or task is asyncio.current_task():
            return
        if grace > 0:
            await asyncio.wait([task], timeout=grace)
        if not task.done():
            task.cancel()  # its teardown (engine, sockets) still runs, in its finally blocks
            await asyncio.wait([task], timeout=_DEAD_STAGE_WAIT_S)
            if not task.done():
                logger.warning("stage %d (on the client's loop): its task did not end", self.stage_id)

    def _reap_process(self, grace: float) -> None:
        """A synchronous shutdown (see the class docstring)."""
        task = self.task
        if task is None or task.done():
            return
        where = loop_context(self._loop)
        if where is LoopContext.OTHER_THREAD:  # the loop runs the stage's teardown; wait for it here
            if not self._ended.wait(grace):
                self._loop.call_soon_threadsafe(task.cancel)
                self._ended.wait(_DEAD_STAGE_WAIT_S)
            return
        # (SHUTDOWN may be unread on the socket: the loop does not run.)
        on_loop_thread = threading.get_ident() == self._loop_thread
        if on_loop_thread:
            self.core.request_stop()
        elif not self._loop.is_closed():  # (a loop another thread is about to run again)
            self._loop.call_soon_threadsafe(self.core.request_stop)
        if (where is LoopContext.NOT_RUNNING and on_loop_thread and not self._loop.is_closed()
                and running_loop() is None):
            # Its own thread, between two runs of the loop: nobody else can be running it now.
            self._loop.run_until_complete(asyncio.wait([task], timeout=grace or _DEAD_STAGE_WAIT_S))
        if self._loop.is_closed():
            # Closed under the stage: its tasks and its engine's can never run again. They are
            # ours, not leaks of the caller's: asyncio is told not to report them when collected.
            cancel_now(own_tasks(self._loop))
        elif on_loop_thread and not task.done():
            cancel_now([task])  # its teardown (in its finally blocks) runs when the loop does

    def _release_now(self) -> None:
        if self.core is not None:
            self.core.close_now()  # before the context ends (in the finalizer)
        super()._release_now()


def _cleanup_loop_stage(core: StageEngineCoreInProc, *args: Any) -> None:
    core.close_now()
    cleanup_stage(None, *args)
