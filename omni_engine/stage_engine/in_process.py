"""A stage in a thread of the client's process (``runtime.process: false``).

The same stage core, framing and sockets as a stage process, over
``inproc://`` in the client's ZMQ context: the stage's engine runs on an event
loop of its own in one thread, with its usual input and output threads, so
the orchestrator, the replica set and the wire protocol do not change, and a
round trip skips the kernel. What a thread cannot have, validation refuses:
an environment or devices of its own, a restart (a thread cannot be killed),
replicas, CURVE (nothing outside the process can reach an ``inproc`` socket).
Tensors travel as ZMQ frames, which within a process are not copied; shared
memory would add nothing.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq

from omni_engine.errors import StageDeadError
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.stage_engine.stage_spec import StageProcessSpec

logger = logging.getLogger(__name__)

# How long shutdown waits for a stage thread that was not asked to stop (it died) to end.
_DEAD_THREAD_JOIN_S = 5.0


class InProcessStageClient(StageEngineCoreClient):
    """A stage client whose stage runs in a thread here instead of in a process of its own."""

    def __init__(self, stage_id: int, spec: StageProcessSpec, startup_timeout: float | None = None) -> None:
        spec = spec.replace(connectors=msgspec.structs.replace(spec.connectors, use_shm=False))
        super().__init__(stage_id, process=spec, transport="inproc", startup_timeout=startup_timeout)
        self.thread: threading.Thread | None = None
        self.exit_code: int | None = None

    def _launch(self) -> None:
        from omni_engine.engines import build_stage_engine
        from omni_engine.stage_engine.stage_core_proc import StageEngineCoreProc

        spec, loop = self.process_spec.replace(stage_id=self.stage_id), self._loop
        ctx = zmq.Context.shadow(self._ctx.underlying)  # inproc: both ends in one context
        inp, out, prefix = self.input_address, self.output_address, self.shm_prefix

        def run() -> None:
            code = 1
            try:
                core = StageEngineCoreProc(spec.stage_id, build_stage_engine(spec), inp, out, prefix,
                                           connectors=spec.connectors, ctx=ctx)
                code = core.run()
            except BaseException:  # noqa: BLE001 - the client hears of it as the stage's death
                logger.exception("stage %d (in-process) failed", spec.stage_id)
            finally:
                self.exit_code = code
                try:
                    loop.call_soon_threadsafe(self._on_thread_exit)
                except RuntimeError:  # the client's loop is closed: nobody to tell
                    pass

        self.thread = threading.Thread(target=run, name=f"stage{self.stage_id}-in-process", daemon=True)
        self.thread.start()

    def _on_thread_exit(self) -> None:
        if not self._stopped:
            self._set_dead(StageDeadError(self.stage_id, f"stage {self.stage_id} (in-process thread) exited with "
                                                         f"code {self.exit_code}", self.exit_code))

    def _reap_process(self, grace: float) -> None:
        """Blocking: wait for the stage thread (asked to stop, or ending after a fatal error)."""
        thread = self.thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(grace if grace > 0 else _DEAD_THREAD_JOIN_S)
        if thread.is_alive():
            logger.warning("stage %d (in-process): its thread did not end; it is left to exit with the process",
                           self.stage_id)
