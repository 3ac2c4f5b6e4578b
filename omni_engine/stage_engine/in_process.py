"""A stage in a thread of the client's process (``runtime.process: false``).

The same stage core, framing and sockets as a stage process, over
``inproc://`` in the client's ZMQ context: the stage's engine runs on an event
loop of its own in one thread, which also reads and sends its messages (no
input and output threads), so the orchestrator, the replica set and the wire
protocol do not change, and a round trip skips the kernel. What a thread cannot have, validation refuses:
an environment or devices of its own, a restart (a thread cannot be killed),
replicas, CURVE (nothing outside the process can reach an ``inproc`` socket).
Tensors travel as ZMQ frames, which within a process are not copied; shared
memory would add nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from omni_engine.errors import StageDeadError
from omni_engine.stage_engine.stage_core_proc import StageEngineCoreProc
from omni_engine.stage_engine.socket_reader import SocketReader
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.stage_engine.stage_spec import StageProcessSpec
from omni_engine.wire.protocol import REQUEST_STRUCTS, StageReady, StageRequestType, StageResponseType
from omni_engine.wire.stage_serialization import StageMsgpackDecoder, StageMsgpackEncoder

logger = logging.getLogger(__name__)

# How long shutdown waits for a stage thread that was not asked to stop (it died) to end.
_DEAD_THREAD_JOIN_S = 5.0


class _LoopOutbox:
    """The stage core's response sink when its transport runs on its event loop: ``put`` (on
    the loop) collects, and one flush per loop turn sends everything collected, consecutive
    outputs as one message (what the output thread does in a stage process)."""

    def __init__(self, send: Callable[[list[Any]], object]) -> None:
        self._send = send
        self._items: list[Any] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    def put(self, item: Any) -> None:
        self._items.append(item)
        if len(self._items) == 1:
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        items, self._items = self._items, []
        if items:
            self._send(items)


class StageEngineCoreInProc(StageEngineCoreProc):
    """The stage core with its transport on its own event loop, without the input and output
    threads of a stage process: a request crosses from the client's thread to the stage's and
    back, nothing more (in a process each thread hop is also a GIL hand-over)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._out_q = self._outbox = _LoopOutbox(self._send_collected)
        self._in_sock: zmq.Socket | None = None
        self._out_sock: zmq.Socket | None = None
        self._input_reader: SocketReader | None = None

    def _start_transport(self) -> None:
        loop = self._outbox.loop = asyncio.get_running_loop()
        self._in_sock = self.ctx.socket(zmq.DEALER)
        self._in_sock.setsockopt(zmq.LINGER, 0)
        self._in_sock.connect(self.input_address)
        self._out_sock = self.ctx.socket(zmq.PUSH)
        self._out_sock.setsockopt(zmq.LINGER, 2000)
        self._out_sock.connect(self.output_address)
        self._encoder = StageMsgpackEncoder.from_settings(self.connectors, self.pool)
        ready = StageReady(self.stage_id, os.getpid(), self.shm_prefix, self.engine.info(), self.host_id)
        self._in_sock.send_multipart([StageResponseType.READY.value, msgspec.msgpack.encode(ready)])
        decoders = {t: StageMsgpackDecoder(cls, shm=self.attachments, allow_pickle=self.connectors.allow_pickle)
                    for t, cls in REQUEST_STRUCTS.items()}
        self._input_reader = SocketReader(loop, self._in_sock, lambda frames: self._handle_frames(frames, decoders),
                                          self._on_input_failed)

    def _on_input_failed(self, exc: BaseException) -> None:
        """A stage that cannot read is dead: say so."""
        logger.error("stage %d: input failed", self.stage_id, exc_info=exc)
        self._fatal(exc)

    def _dispatch_threadsafe(self, req_type: StageRequestType, msg: Any) -> None:
        self._dispatch(req_type, msg)  # already on the loop

    def _send_collected(self, items: list[Any]) -> None:
        self._send_items(self._out_sock, self._encoder, items)

    async def _stop_transport(self) -> None:
        if self._input_reader is not None:
            self._input_reader.close()
        self._outbox.flush()  # what is left (a DEAD above all)
        for sock in (self._in_sock, self._out_sock):
            if sock is not None:
                sock.close()
        self.attachments.detach()


class InProcessStageClient(StageEngineCoreClient):
    """A stage client whose stage runs in a thread here instead of in a process of its own."""

    def __init__(self, stage_id: int, spec: StageProcessSpec, startup_timeout: float | None = None) -> None:
        spec = spec.replace(connectors=msgspec.structs.replace(spec.connectors, use_shm=False))
        super().__init__(stage_id, process=spec, transport="inproc", startup_timeout=startup_timeout)
        self.thread: threading.Thread | None = None
        self.exit_code: int | None = None

    async def _launch(self) -> None:
        from omni_engine.engines import build_stage_engine

        spec, loop = self.process_spec.replace(stage_id=self.stage_id), self._loop
        ctx = zmq.Context.shadow(self._ctx.underlying)  # inproc: both ends in one context
        inp, out, prefix = self.input_address, self.output_address, self.shm_prefix

        def run() -> None:
            code = 1
            try:
                core = StageEngineCoreInProc(spec.stage_id, build_stage_engine(spec), inp, out, prefix,
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
        if self._stopped:
            return
        # The thread sent everything before it ended (its ERRORs, its DEAD), but this callback
        # may come before the output task has read them: read them first, so that they, not
        # the bare exit, say what happened.
        sock = zmq.Socket.shadow(self._output.underlying)
        while self.dead_error is None:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._take_response(frames)
        if self.dead_error is None:
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
