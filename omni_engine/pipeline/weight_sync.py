"""``WeightSync``: vLLM's weight-update protocol over every replica of a pipeline's llm stages.

vLLM's ``EngineClient`` weight methods address one engine. A pipeline has
several llm stages, each with replicas, and a push must land on all of them or
on none. So a push is two-phase here: every replica stages and checks what
arrives (``update_weights``); ``finish_weight_update`` first asks every replica
whether its push is complete (``check_staged``), and only when all say yes do
they load it. A call that fails anywhere aborts the update everywhere and names
the stage and replica; the model keeps serving the weights it had.

What vLLM leaves to its caller is kept here: versions only move forward; an
update nobody drives any more (the trainer died) is abandoned after
``weights.idle_timeout_s``, its push dropped, the pipeline resumed; the last
push is saved where a restarted replica loads it before it takes a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from omni_engine.config import STAGED_WEIGHT_BACKENDS, WeightsConfig
from omni_engine.pipeline.stage_context import StageContext
from omni_engine.stage_engine.base_client import BaseStageClient
from omni_engine.weights.store import WeightStore

logger = logging.getLogger(__name__)

# vLLM's engines start with this version label.
INITIAL_VERSION = "default"


class WeightUpdateError(ValueError):
    """A weight call that was refused or failed; it names stage, replica and what was wrong.

    A ValueError, so vLLM's server answers it with 400 and its message.
    """


def check_version_order(current: str, new: str) -> None:
    """Versions move forward: integers must increase; other labels must differ from the current one."""
    if not isinstance(new, str) or not new:
        raise WeightUpdateError(f"weight version must be a non-empty string, got {new!r}")
    if current.lstrip("-").isdigit() and new.lstrip("-").isdigit():
        if int(new) <= int(current):
            raise WeightUpdateError(f"weight version {new!r} does not increase: the pipeline is on version "
                                    f"{current!r}")
    elif new == current:
        raise WeightUpdateError(f"weight version {new!r} is the version the pipeline is on already")


class WeightSync:
    """The weight methods of ``MultiStageEngineClient``, over the chosen stages' replicas."""

    def __init__(self, stages: Sequence[StageContext], config: WeightsConfig,
                 resume: Callable[[], Awaitable[None]]) -> None:
        """``resume``: the client's ``resume_generation`` (an abandoned update resumes the pipeline)."""
        self.stages = list(stages)
        self.config = config
        self.staged = config.backend in STAGED_WEIGHT_BACKENDS
        self.version = INITIAL_VERSION
        self.updates = 0  # committed pushes
        self._resume = resume
        self._active = False
        self._init_info: dict[str, Any] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._abandoning: asyncio.Task | None = None
        # The last push, for replicas that start later (only the staged backends can keep it).
        self._store: WeightStore | None = None
        # Seconds per phase of the last update (start, transfer, check, commit): for
        # the log and benchmarks/bench_weight_update.py.
        self.timings: dict[str, float] = {}

    @property
    def stage_ids(self) -> list[int]:
        return [ctx.stage_id for ctx in self.stages]

    @property
    def active(self) -> bool:
        """An update is between ``start_weight_update`` and its finish or abort."""
        return self._active

    # ------------------------------------------------------------ fan-out
    async def _each(self, method: str, *args: Any, **kwargs: Any) -> dict[tuple[int, int], Any]:
        """Call ``method`` on every live replica of every chosen stage; (stage, replica) -> result.
        Any failure raises one WeightUpdateError naming every replica that failed."""
        if not self.stages:
            raise WeightUpdateError("this pipeline has no stage that takes weight updates (weights.stages)")
        per_stage = await asyncio.gather(*(
            ctx.client.call_each_replica_async(method, *args, return_exceptions=True, **kwargs)
            for ctx in self.stages), return_exceptions=True)
        results, failures = {}, []
        for ctx, replies in zip(self.stages, per_stage):
            if isinstance(replies, BaseException):
                failures.append(f"stage {ctx.stage_id}: {replies}")
                continue
            for replica, value in replies.items():
                if isinstance(value, BaseException):
                    failures.append(f"stage {ctx.stage_id} replica {replica}: {_reason(value)}")
                else:
                    results[(ctx.stage_id, replica)] = value
        if failures:
            raise WeightUpdateError(f"{method} failed on " + "; ".join(failures))
        return results

    # ----------------------------------------------------------- protocol
    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self._each("init_weight_transfer_engine", dict(init_info))
        self._init_info = dict(init_info)  # a replica that restarts gets it too

    async def shutdown_weight_transfer_engine(self) -> None:
        if self._active:
            raise WeightUpdateError("shutdown_weight_transfer_engine during a weight update; finish or abort "
                                    "it first")
        await self._each("shutdown_weight_transfer_engine")
        self._init_info = None

    async def start_weight_update(self, draft: bool = False) -> None:
        if self._active:
            raise WeightUpdateError("start_weight_update: a weight update is already under way; finish it "
                                    "(finish_weight_update) first")
        self._active = True
        t0 = time.perf_counter()
        self.timings = {"transfer": 0.0}
        try:
            await self._each("start_draft_weight_update" if draft else "start_weight_update")
        except BaseException:
            await self.abort()
            raise
        self.timings["start"] = time.perf_counter() - t0
        if self.staged:
            self._store = self._store or WeightStore(self.config.store_dir)
            self._store.begin()
        self._touch()

    async def update_weights(self, update_info: Any) -> None:
        if not self._active:
            raise WeightUpdateError("update_weights without start_weight_update: call start_weight_update first "
                                    "(nothing was loaded)")
        self._cancel_idle()  # the clock runs between calls, not while one is under way
        t0 = time.perf_counter()
        try:
            if self._store is not None:
                # The store writes the chunk while the stages stage it (the sender reuses its buffer next).
                staged, stored = await asyncio.gather(self._each("update_weights", update_info),
                                                      asyncio.to_thread(self._write_chunk, update_info),
                                                      return_exceptions=True)
                for result in (staged, stored):  # the stages' error names the replicas: it goes first
                    if isinstance(result, BaseException):
                        raise result
            else:
                await self._each("update_weights", update_info)
            self.timings["transfer"] = self.timings.get("transfer", 0.0) + time.perf_counter() - t0
        except BaseException as exc:
            await self.abort()
            raise WeightUpdateError(f"{exc}; the update is aborted on every replica, which keep serving "
                                    f"version {self.version!r}") from None
        self._touch()

    def _write_chunk(self, update_info: Any) -> None:
        assert self._store is not None
        try:
            self._store.write_chunk(update_info, self._init_info)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightUpdateError(f"update_weights: the pipeline could not keep the chunk for replicas that "
                                    f"restart later ({type(exc).__name__}: {exc}); set weights.store_dir to a "
                                    "directory with room for the model") from None

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        if not self._active:
            raise WeightUpdateError("finish_weight_update without start_weight_update (nothing to finish)")
        self._cancel_idle()
        t0 = time.perf_counter()
        try:
            if weight_version is not None:
                check_version_order(self.version, weight_version)
            if self.staged:
                # Every replica has the whole push, checked, before any replica loads it.
                await self._each("check_staged")
                self.timings["check"] = time.perf_counter() - t0
        except BaseException as exc:
            await self.abort()
            if isinstance(exc, WeightUpdateError):
                raise WeightUpdateError(f"{exc}; the update is aborted on every replica, which keep serving "
                                        f"version {self.version!r}") from None
            raise
        t0 = time.perf_counter()
        try:
            await self._each("finish_weight_update", weight_version)
        finally:
            self._active = False
        self.timings["commit"] = time.perf_counter() - t0
        if weight_version is not None:
            self.version = weight_version
        self.updates += 1
        if self._store is not None:
            self._store.commit()
        logger.info("weight update committed on stages %s: version %r (%s)", self.stage_ids, self.version,
                    ", ".join(f"{k} {v:.3f} s" for k, v in self.timings.items()))

    async def update_weight_version(self, new_version: str) -> None:
        check_version_order(self.version, new_version)
        await self._each("update_weight_version", new_version)
        self.version = new_version

    async def get_weight_version(self) -> str:
        """The version every chosen replica is on; an error naming who holds what when they differ."""
        held = await self._each("get_weight_version")
        versions = set(held.values())
        if len(versions) == 1:
            return versions.pop()
        who = ", ".join(f"stage {s} replica {r}: {v!r}" for (s, r), v in sorted(held.items()))
        raise WeightUpdateError(f"the replicas disagree on the weight version ({who})")

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        """vLLM's per-worker digests, their keys prefixed with stage and replica (``s0.r1.rank0...``):
        replicas hold the same names, and vLLM's ``/weight_checker`` refuses duplicate keys."""
        held = await self._each("compute_weight_checksums")
        return [{f"s{sid}.r{replica}.{key}": digest for key, digest in worker.items()}
                for (sid, replica), workers in sorted(held.items()) for worker in workers]

    async def abort(self) -> None:
        """Drop the update under way on every replica (best effort: a failing replica is logged)."""
        self._cancel_idle()
        self._active = False
        if self._store is not None:
            self._store.abort()
        if not self.staged:
            return
        try:
            await self._each("abort_weight_update")
        except WeightUpdateError as exc:
            logger.warning("aborting the weight update: %s", exc)

    # --------------------------------------------------------- abandonment
    def _touch(self) -> None:
        self._cancel_idle()
        loop = asyncio.get_running_loop()
        self._idle = loop.call_later(self.config.idle_timeout_s, self._abandon)

    def _cancel_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _abandon(self) -> None:
        self._idle = None
        if self._active:
            self._abandoning = asyncio.get_running_loop().create_task(self._abandon_now(), name="weights-abandon")

    async def _abandon_now(self) -> None:
        logger.warning("weight update abandoned: no call for %.0f s (weights.idle_timeout_s; did the trainer "
                       "exit?); its push is dropped, every replica keeps version %r, and the pipeline resumes",
                       self.config.idle_timeout_s, self.version)
        await self.abort()
        await self._resume()

    # ------------------------------------------------- restarted replicas
    async def prepare_replica(self, stage_id: int, replica: int, client: BaseStageClient) -> None:
        """Bring a new replica process onto the pipeline's current weights before it serves.

        Raises when it cannot (the supervisor does not readmit it): a replica never comes
        back silently on weights older than its siblings'.
        """
        if stage_id not in self.stage_ids:
            return
        if self._init_info is not None:
            await client.call_utility_async("init_weight_transfer_engine", self._init_info)
        if self.updates == 0:
            if self.version != INITIAL_VERSION:
                await client.call_utility_async("update_weight_version", self.version)
            return
        files = self._store.files() if self._store is not None else []
        if not files:
            raise WeightUpdateError(f"stage {stage_id} replica {replica}: cannot bring it back on weight version "
                                    f"{self.version!r}: backend {self.config.backend!r} loads weights as they "
                                    "arrive and keeps no copy; push the weights again")
        # The store holds the weights of the last commit; the version label may have moved since.
        await client.call_utility_async("restore_weights", files, self.version)
        logger.info("stage %d replica %d: restored weight version %r", stage_id, replica, self.version)

    async def close(self) -> None:
        if self._abandoning is not None and not self._abandoning.done():
            self._abandoning.cancel()
        self.close_now()

    def close_now(self) -> None:
        self._cancel_idle()
        if self._store is not None:
            self._store.close()
            self._store = None


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
