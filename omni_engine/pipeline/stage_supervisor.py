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
from collections.abc import Awaitable, Callable, Sequence

from omni_engine.pipeline.replica_set import StageReplicaSet
from omni_engine.pipeline.stage_context import StageContext
from omni_engine.errors import StageDeadError
from omni_engine.loop_context import cancel_now
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


class StageSupervisor:
    """Watches every replicated stage with a restart policy and a way to make a new replica."""

    def __init__(self, stages: Sequence[StageContext], makers: dict[int, StageClientMaker],
                 prepare_replica: ReplicaPreparer | None = None) -> None:
        self._stages = {ctx.stage_id: ctx for ctx in stages}
        self._makers = makers
        self._prepare = prepare_replica
        self._replica_restarts: dict[tuple[int, int], int] = {}
        self._tasks: dict[tuple[int, int], asyncio.Task] = {}
        self._stopped = False
        for ctx in stages:
            if self._policy(ctx)[0] == "on-failure" and ctx.stage_id in self._makers \
                    and isinstance(ctx.client, StageReplicaSet):
                ctx.client.on_replica_dead = lambda replica, error, ctx=ctx: self._on_dead(ctx, replica, error)

    def _policy(self, ctx: StageContext) -> tuple[str, int]:
        runtime = ctx.stage_config.runtime if ctx.stage_config is not None else None
        if runtime is None:
            return "no", 0
        return runtime.restart, DEFAULT_MAX_RESTARTS if runtime.max_restarts is None else runtime.max_restarts

    @property
    def restarts(self) -> dict[int, int]:
        """Per stage: restarts of all its replicas."""
        counts = {sid: 0 for sid in self._stages}
        for (sid, _), n in self._replica_restarts.items():
            counts[sid] += n
        return counts

    def restarting(self, stage_id: int) -> bool:
        return any(sid == stage_id and not task.done() for (sid, _), task in self._tasks.items())

    def _on_dead(self, ctx: StageContext, replica: int, error: StageDeadError) -> None:
        key = (ctx.stage_id, replica)
        task = self._tasks.get(key)
        if self._stopped or (task is not None and not task.done()):
            return
        _, limit = self._policy(ctx)
        done = self._replica_restarts.get(key, 0)
        if done >= limit:
            logger.error("stage %d replica %d died and is not restarted: it was restarted %d time(s), the limit "
                         "(runtime.max_restarts)", ctx.stage_id, replica, done)
            return
        self._tasks[key] = asyncio.get_running_loop().create_task(
            self._restart(ctx, replica, error), name=f"restart-stage{ctx.stage_id}-replica{replica}")

    async def _restart(self, ctx: StageContext, replica: int, error: StageDeadError) -> None:
        sid, key = ctx.stage_id, (ctx.stage_id, replica)
        replicas: StageReplicaSet = ctx.client
        _, limit = self._policy(ctx)
        delay = _FIRST_DELAY_S
        while not self._stopped and self._replica_restarts.get(key, 0) < limit:
            self._replica_restarts[key] = self._replica_restarts.get(key, 0) + 1
            logger.warning("stage %d replica %d died (%s); restarting it (restart %d of at most %d)",
                           sid, replica, str(error).splitlines()[0], self._replica_restarts[key], limit)
            # Reap what is left of the old one: process group, sockets, segments.
            await replicas.replicas[replica].shutdown()
            client = self._makers[sid](replica)
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
