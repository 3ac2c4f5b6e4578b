"""``StageSupervisor``: starts a stage replica again when it dies (``runtime.restart: on-failure``).

A replica that dies is evicted by its ``StageReplicaSet`` (what it ran moves
to a live replica or fails, naming stage and replica); the supervisor then
makes a new client and process for that replica only and readmits it, so the
stage serves at full strength again. While no replica of a stage lives,
requests that need it fail at once and ``check_health`` (the server's
``/health``) reports it. Restarts are limited per replica
(``runtime.max_restarts``) and spaced by a growing delay, so a replica that
cannot start does not spin.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from omni_engine.errors import StageDeadError
from omni_engine.loop_context import cancel_now
from omni_engine.pipeline.replica_set import StageReplicaSet
from omni_engine.stage_engine.base_client import BaseStageClient
from omni_engine.stage_engine.stage_launch import LaunchedStage, discard_launched, launch_spare
from omni_engine.stage_engine.stage_spec import StageProcessSpec
from omni_engine.utils import describe_exit

logger = logging.getLogger(__name__)


class StageClientMaker(Protocol):
    """Makes the client (and process) of one replica of a stage, given the replica's index; with
    ``spare``, the client adopts that warm spare instead of starting a process."""

    def __call__(self, replica: int, spare: LaunchedStage | None = None) -> BaseStageClient: ...

# Brings a started replica up to date before it serves (stage id, replica, client); raising
# fails the restart (e.g. it cannot be put on the pipeline's current weights).
ReplicaPreparer = Callable[[int, int, BaseStageClient], Awaitable[None]]

DEFAULT_MAX_RESTARTS = 3
_FIRST_DELAY_S = 0.5
SPARE_RELAUNCH_DELAY_S = 5.0
_MAX_DELAY_S = 10.0


@dataclass(frozen=True, slots=True)
class RestartableStage:
    """A stage whose replicas are restarted when they die (``runtime.restart: on-failure``)."""

    replicas: StageReplicaSet
    make_replica: StageClientMaker
    max_restarts: int = DEFAULT_MAX_RESTARTS
    # What the stage's warm spare is started from (``runtime.warm_spare``); None: it has none.
    spare_spec: StageProcessSpec | None = None


class StageSupervisor:
    """Restarts the dead replicas of the stages it is given, one by one, up to their limit."""

    def __init__(self, stages: Mapping[int, RestartableStage], prepare_replica: ReplicaPreparer | None = None) -> None:
        self._stages = dict(stages)
        self._prepare = prepare_replica
        self._replica_restarts: dict[tuple[int, int], int] = {}
        self._tasks: dict[tuple[int, int], asyncio.Task] = {}
        self._stopped = False
        # Per stage, its warm spare waiting to be taken; stopped with the supervisor, at the latest
        # at this process's exit.
        self._spares: dict[int, LaunchedStage] = {}
        self._spares_finalizer = weakref.finalize(self, discard_launched, self._spares)
        for sid, stage in self._stages.items():
            stage.replicas.on_replica_dead = lambda replica, error, sid=sid: self._on_dead(sid, replica, error)

    def launch_spares(self) -> None:
        """Start the warm spare of every stage that has one (after the pipeline's start, which they would slow)."""
        for sid in self._stages:
            self._launch_spare(sid)

    @property
    def spares(self) -> dict[int, LaunchedStage]:
        """Per stage with a warm spare waiting (or starting): that spare."""
        return dict(self._spares)

    def _launch_spare(self, sid: int) -> None:
        spec = self._stages[sid].spare_spec
        if spec is None or self._stopped or sid in self._spares:
            return
        try:
            self._spares[sid] = launch_spare(sid, spec)
        except OSError as exc:  # the stage serves on; its next restart is a cold one
            logger.error("stage %d: its warm spare could not be started: %s", sid, exc)

    def _take_spare(self, sid: int) -> LaunchedStage | None:
        spare = self._spares.pop(sid, None)
        if spare is not None and not spare.process.waiting_spare:
            logger.warning("stage %d: its warm spare (pid %s) %s; restarting cold", sid, spare.process.pid,
                           describe_exit(spare.process.exitcode))
            spare.discard()
            return None
        return spare

    @property
    def restarts(self) -> dict[int, int]:
        """Per supervised stage: restarts of all its replicas."""
        counts = {sid: 0 for sid in self._stages}
        for (sid, _), n in self._replica_restarts.items():
            counts[sid] += n
        return counts

    def restarting(self, stage_id: int) -> bool:
        return any(sid == stage_id and not task.done() for (sid, _), task in self._tasks.items())

    def _on_dead(self, sid: int, replica: int, error: StageDeadError) -> None:
        key = (sid, replica)
        task = self._tasks.get(key)
        if self._stopped or (task is not None and not task.done()):
            return
        done = self._replica_restarts.get(key, 0)
        if done >= self._stages[sid].max_restarts:
            logger.error("stage %d replica %d died and is not restarted: it was restarted %d time(s), the limit "
                         "(runtime.max_restarts)", sid, replica, done)
            return
        self._tasks[key] = asyncio.get_running_loop().create_task(
            self._restart(sid, replica, error), name=f"restart-stage{sid}-replica{replica}")

    async def _restart(self, sid: int, replica: int, error: StageDeadError) -> None:
        key = (sid, replica)
        stage = self._stages[sid]
        replicas, limit = stage.replicas, stage.max_restarts
        delay = _FIRST_DELAY_S
        while not self._stopped and self._replica_restarts.get(key, 0) < limit:
            self._replica_restarts[key] = self._replica_restarts.get(key, 0) + 1
            logger.warning("stage %d replica %d died (%s); restarting it (restart %d of at most %d)",
                           sid, replica, str(error).splitlines()[0], self._replica_restarts[key], limit)
            # Reap what is left of the old one: process group, sockets, segments.
            await replicas.replicas[replica].shutdown()
            spare = self._take_spare(sid)
            client = stage.make_replica(replica, spare)
            try:
                await client.start()
                if self._prepare is not None:
                    await self._prepare(sid, replica, client)
            except Exception as exc:  # noqa: BLE001 - retried with a delay until the limit
                logger.error("stage %d replica %d: restart failed: %s", sid, replica, exc)
                await client.shutdown()
                await asyncio.sleep(delay)
                delay = min(2 * delay, _MAX_DELAY_S)
                continue
            if self._stopped:
                await client.shutdown()
                return
            replicas.readmit(replica, client)
            logger.warning("stage %d replica %d is back (pid %s%s)", sid, replica,
                           client.ready.pid if client.ready else "?", ", its warm spare" if spare else "")
            # The next spare, once the replica has served its first requests: its imports take the
            # cores for seconds (here a first request after a restart took 4.2 s with the next spare
            # importing beside it, 0.1 s without).
            asyncio.get_running_loop().call_later(SPARE_RELAUNCH_DELAY_S, self._launch_spare, sid)
            return

    def stop_now(self) -> None:
        """No more restarts; one under way is cancelled, not awaited (a synchronous shutdown)."""
        self._stopped = True
        cancel_now(self._tasks.values())
        discard_launched(self._spares)

    async def stop(self) -> None:
        """No more restarts; wait for one under way to give up."""
        self._stopped = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        discard_launched(self._spares)
