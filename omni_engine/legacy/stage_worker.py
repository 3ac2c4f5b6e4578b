"""The legacy stage process: the same ``StageEngineCore`` fed by ``multiprocessing.Queue``.

What vLLM-Omni's ``_stage_worker`` did before the refactor: requests arrive on
an input queue and every answer is ``put`` on an output queue, pickled by the
queue's feeder thread. Nothing else differs from a ZMQ stage (same engine,
same request handling, same errors), so the benchmarks compare transports.
Tensors travel as pickle does them: ``torch`` registers reducers that move a
tensor's storage into shared memory and pass its file descriptor; numpy
arrays and bytes are copied through the pipe.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

from omni_engine.engines.base import StageEngine
from omni_engine.legacy.queues import StageQueue
from omni_engine.wire.protocol import (
    StageGenerateRequest,
    StageReady,
    StageRequestType,
    StageResponseType,
)
from omni_engine.stage_engine.stage_core import StageEngineCore
from omni_engine.stage_engine.stage_entry import serve_stage
from omni_engine.stage_engine.stage_spec import StageProcessSpec

logger = logging.getLogger(__name__)

# How long a stopping stage waits for its queue's feeder thread to hand the
# last answers (DEAD, say) to a client that may have stopped reading.
_FLUSH_TIMEOUT_S = 5.0


class LegacyStageWorker(StageEngineCore):
    """Serves one engine on an input and an output ``multiprocessing.Queue``."""

    def __init__(self, stage_id: int, engine: StageEngine, in_q: StageQueue, out_q: StageQueue) -> None:
        super().__init__(stage_id, engine, out_q)
        self._in_q = in_q

    def _trace(self, req: StageGenerateRequest) -> None:
        """The legacy architecture is not traced: its answers are single outputs on a queue."""

    def _start_transport(self) -> None:
        # This process only writes out_q and reads in_q; the other ends are
        # inherited copies. Closed, a client that dies breaks both pipes: the
        # feeder thread gets EPIPE instead of blocking forever on a full pipe
        # that this process itself keeps a reader of, and the input thread EOF.
        self._out_q.close_read_end()
        self._in_q.close_write_end()
        self._out_q.put((StageResponseType.READY, StageReady(self.stage_id, os.getpid(), "", self.engine.info())))
        # Daemonic: it blocks in get() and dies with the process.
        threading.Thread(target=self._input_thread, name="legacy-stage-input", daemon=True).start()

    def _input_thread(self) -> None:
        get = self._in_q.get
        while True:
            try:
                req_type, msg = get()
                req_type = StageRequestType(req_type)
            except (EOFError, OSError):
                return  # the client closed its end
            except Exception as exc:  # noqa: BLE001 - one bad task must not stop the stage
                logger.warning("stage %d: dropping malformed task: %s: %s", self.stage_id, type(exc).__name__, exc)
                continue
            self._dispatch_threadsafe(req_type, msg)
            if req_type is StageRequestType.SHUTDOWN:
                return

    async def _stop_transport(self) -> None:
        """Give the feeder thread ``_FLUSH_TIMEOUT_S`` to hand over the last answers, then go.

        The wait runs in a daemon thread, not the loop's executor: a feeder
        stuck on a client that stopped reading must not keep the process
        (whose event loop joins its executor on close) from exiting.
        """
        loop = asyncio.get_running_loop()
        flushed = loop.create_future()

        def join() -> None:
            self._out_q.join_thread()
            try:
                loop.call_soon_threadsafe(lambda: flushed.done() or flushed.set_result(None))
            except RuntimeError:  # loop closed: nobody waits any more
                pass

        self._out_q.close()
        threading.Thread(target=join, name="legacy-stage-flush", daemon=True).start()
        try:
            await asyncio.wait_for(flushed, _FLUSH_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("stage %d: client stopped reading; dropping unsent answers", self.stage_id)
            self._out_q.cancel_join_thread()


LEGACY_STAGE_MAIN = "omni_engine.legacy.stage_worker:serve_legacy_stage"


def serve_legacy_stage(spec: StageProcessSpec, in_q: StageQueue, out_q: StageQueue) -> None:
    """A legacy stage process's serving function (after ``stage_entry`` set the process up)."""
    from omni_engine.engines import build_stage_engine

    def make_core() -> LegacyStageWorker:
        return LegacyStageWorker(spec.stage_id, build_stage_engine(spec), in_q, out_q)

    serve_stage(spec.stage_id, make_core)
