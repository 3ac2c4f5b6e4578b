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
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from omni_engine.errors import StageDeadError
from omni_engine.loop_context import cancel_now
from omni_engine.pipeline.replica_set import StageReplicaSet
from omni_engine.stage_engine.base_client import BaseStageClient

logger = logging.getLogger(__name__)

# Makes the client (and process) of one replica of a stage, given the replica's index.
StageClientMaker = Callable[[int], BaseStageClient]
# Brings a started replica up to date before it serves (stage id, replica, client); raising
# fails the restart (e.g. it cannot be put on the pipeline's current weights).
ReplicaPreparer = Callable[[int, int, BaseStageClient], Awaitable[None]]

DEFAULT_MAX_RESTARTS = 3
_FIRST_DELAY_S = 0.5
_MAX_DELAY_S = 10.0


@dataclass(frozen=True, slots=True)
class RestartableStage:
    """A stage whose replicas are restarted when they die (``runtime.restart: on-failure``)."""

    replicas: StageReplicaSet
    make_replica: StageClientMaker
    max_restarts: int = DEFAULT_MAX_RESTARTS


class StageSupervisor:
    """Restarts the dead replicas of the stages it is given, one by one, up to their limit."""

    def __init__(self, stages: Mapping[int, RestartableStage], prepare_replica: ReplicaPreparer | None = None) -> None:
        self._stages = dict(stages)
        self._prepare = prepare_replica
        self._replica_restarts: dict[tuple[int, int], int] = {}
        self._tasks: dict[tuple[int, int], asyncio.Task] = {}
        self._stopped = False
        for sid, stage in self._stages.items():
            stage.replicas.on_replica_dead = lambda replica, error, sid=sid: self._on_dead(sid, replica, error)

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
            client = stage.make_replica(replica)
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
            logger.warning("stage %d replica %d is back (pid %s)", sid, replica,
                           client.ready.pid if client.ready else "?")
            return

    def stop_now(self) -> None:
        """No more restarts; one under way is cancelled, not awaited (a synchronous shutdown)."""
        self._stopped = True
        cancel_now(self._tasks.values())

    async def stop(self) -> None:
        """No more restarts; wait for one under way to give up."""
        self._stopped = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
