"""``StageSupervisor``: starts a stage again when it dies (``runtime.restart: on-failure``).

A stage that dies fails the requests in flight through it (the orchestrator
does that, naming the stage); the supervisor then replaces the stage's client
with a new one and a new process, so that later requests succeed. While the
stage is down, requests that need it fail at once and ``check_health`` (the
server's ``/health``) reports it. Restarts are limited per stage
(``runtime.max_restarts``) and spaced by a growing delay, so a stage that
cannot start does not spin.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from omni_engine.pipeline.stage_context import StageContext
from omni_engine.errors import StageDeadError
from omni_engine.loop_context import cancel_now
from omni_engine.stage_engine.base_client import BaseStageClient

logger = logging.getLogger(__name__)

StageClientMaker = Callable[[], BaseStageClient]

DEFAULT_MAX_RESTARTS = 3
_FIRST_DELAY_S = 0.5
_MAX_DELAY_S = 10.0


class StageSupervisor:
    """Watches every stage with a restart policy and a way to make a new client."""

    def __init__(self, stages: Sequence[StageContext], makers: dict[int, StageClientMaker]) -> None:
        self._stages = {ctx.stage_id: ctx for ctx in stages}
        self._makers = makers
        self.restarts: dict[int, int] = {sid: 0 for sid in self._stages}
        self._tasks: dict[int, asyncio.Task] = {}
        self._stopped = False
        for ctx in stages:
            self._watch(ctx)

    def _policy(self, ctx: StageContext) -> tuple[str, int]:
        runtime = ctx.stage_config.runtime if ctx.stage_config is not None else None
        if runtime is None:
            return "no", 0
        return runtime.restart, DEFAULT_MAX_RESTARTS if runtime.max_restarts is None else runtime.max_restarts

    def _watch(self, ctx: StageContext) -> None:
        if self._policy(ctx)[0] == "on-failure" and ctx.stage_id in self._makers:
            ctx.client.on_dead = lambda error, ctx=ctx: self._on_dead(ctx, error)

    def restarting(self, stage_id: int) -> bool:
        task = self._tasks.get(stage_id)
        return task is not None and not task.done()

    def _on_dead(self, ctx: StageContext, error: StageDeadError) -> None:
        if self._stopped or self.restarting(ctx.stage_id):
            return
        _, limit = self._policy(ctx)
        if self.restarts[ctx.stage_id] >= limit:
            logger.error("stage %d died and is not restarted: it was restarted %d time(s), the limit "
                         "(runtime.max_restarts)", ctx.stage_id, self.restarts[ctx.stage_id])
            return
        self._tasks[ctx.stage_id] = asyncio.get_running_loop().create_task(
            self._restart(ctx, error), name=f"restart-stage{ctx.stage_id}")

    async def _restart(self, ctx: StageContext, error: StageDeadError) -> None:
        sid = ctx.stage_id
        _, limit = self._policy(ctx)
        delay = _FIRST_DELAY_S
        while not self._stopped and self.restarts[sid] < limit:
            self.restarts[sid] += 1
            logger.warning("stage %d died (%s); restarting it (restart %d of at most %d)",
                           sid, str(error).splitlines()[0], self.restarts[sid], limit)
            await ctx.client.shutdown()  # reap what is left of the old one: process group, sockets, segments
            client = self._makers[sid]()
            try:
                await client.start()
            except Exception as exc:  # noqa: BLE001 - retried with a delay until the limit
                logger.error("stage %d: restart %d failed: %s", sid, self.restarts[sid], exc)
                await client.shutdown()
                await asyncio.sleep(delay)
                delay = min(2 * delay, _MAX_DELAY_S)
                continue
            if self._stopped:
                await client.shutdown()
                return
            ctx.client = client
            self._watch(ctx)
            logger.warning("stage %d is back (pid %s)", sid, client.ready.pid if client.ready else "?")
            return

    def stop_now(self) -> None:
        """No more restarts; one under way is cancelled, not awaited (a synchronous shutdown)."""
        self._stopped = True
        tasks = list(self._tasks.values())
        cancel_now(tasks, tasks[0].get_loop() if tasks else None)

    async def stop(self) -> None:
        """No more restarts; wait for one under way to give up."""
        self._stopped = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
