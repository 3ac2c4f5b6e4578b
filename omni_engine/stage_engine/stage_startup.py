"""Waiting for a stage's READY: the startup handshake on the client's ROUTER.

READY tells the client the stage's identity (where requests go) and its shm
prefix (what to unlink if it dies), so it is checked before it is believed:
a peer that is not our stage must neither take over nor fail the startup.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
import zmq

from omni_engine.connectors.shm import is_stage_prefix
from omni_engine.errors import StageStartupError
from omni_engine.wire.protocol import StageReady, StageResponseType
from omni_engine.stage_engine.stage_process import StageProcess
from omni_engine.stage_engine.stage_sockets import recv_frames

logger = logging.getLogger(__name__)

ReadyCheck = Callable[[StageReady], "str | None"]
T = TypeVar("T")


def check_ready(ready: StageReady, stage_id: int, shm_prefix: str, process: StageProcess | None) -> str | None:
    """Why ``ready`` cannot be this stage's, or None.

    Its shm prefix decides which segments are unlinked when the stage dies, so
    it must be the one we gave our process (or, for a stage started elsewhere,
    a stage prefix at all).
    """
    if ready.stage_id != stage_id:
        return f"it is from stage {ready.stage_id}"
    if not is_stage_prefix(ready.shm_prefix):
        return f"shm prefix {ready.shm_prefix!r:.80} is not a stage prefix"
    if process is not None and ready.shm_prefix != shm_prefix:
        return f"shm prefix {ready.shm_prefix!r:.80} is not {shm_prefix!r}"
    if process is not None and ready.pid != process.pid:
        return f"pid {ready.pid} is not our stage process's ({process.pid})"
    return None


async def recv_ready(sock: zmq.Socket, stage_id: int,
                     check: Callable[[StageReady], str | None]) -> tuple[bytes, StageReady]:
    """The identity and READY of the first peer whose READY ``check`` accepts (None: no problem).

    Anything else is logged and skipped: a peer that is not our stage must not
    fail or take over the startup.
    """
    decoder = msgspec.msgpack.Decoder(StageReady)
    while True:
        frames = await recv_frames(sock)
        if len(frames) != 3 or frames[1] != StageResponseType.READY.value:
            logger.warning("stage %d: unexpected message before READY ignored (%d frames)", stage_id, len(frames))
            continue
        try:
            ready = decoder.decode(frames[2])
        except msgspec.DecodeError as exc:
            logger.warning("stage %d: malformed READY ignored: %s", stage_id, exc)
            continue
        problem = check(ready)
        if problem is None:
            return frames[0], ready
        logger.warning("stage %d: READY ignored: %s", stage_id, problem)


async def wait_ready(stage_id: int, process: StageProcess | None, timeout: float,
                     receive: Awaitable[T], hint: str = "") -> T:
    """What ``receive`` gives (the stage's READY, however the transport gets it);
    ``StageStartupError`` if the stage's process exits first or time runs out.

    The one startup wait of every stage client, whatever its transport:
    ``hint`` adds a transport's likely cause to the timeout message.
    """
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    if process is not None:
        loop.add_reader(process.sentinel, lambda: exited.done() or exited.set_result(None))
    ready_task = asyncio.ensure_future(receive)
    try:
        done, _ = await asyncio.wait({ready_task, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if process is not None:
            loop.remove_reader(process.sentinel)
        ready_task.cancel()
    if ready_task in done and not ready_task.cancelled() and ready_task.exception() is None:
        return ready_task.result()
    if exited in done:
        process.join(1)
        tail = process.log_tail()
        detail = (f"last lines of {process.log_path}:\n{tail}" if tail else
                  "it wrote no log, so it failed before the stage code ran (legacy stages are spawned "
                  "by multiprocessing: a script that starts them needs an `if __name__ == '__main__':` guard)")
        raise StageStartupError(stage_id, f"{process.describe_exit()} during startup; {detail}", process.exitcode)
    if ready_task in done and not ready_task.cancelled():  # the transport failed (not a timeout): its own error says why
        ready_task.result()
    tail = f"; last lines of {process.log_path}:\n{process.log_tail()}" if process else ""
    raise StageStartupError(stage_id, f"stage {stage_id} did not become ready within {timeout:g} s{hint}{tail}")

