"""``RaySampler``: data-parallel sampling over K Ray actors, each holding a pipeline.

Each ``SamplingWorker`` actor starts an ``EngineSampler`` (its pipeline's stage
processes are the actor's children) once and keeps it across rounds and
shards. The driver gives every worker ``concurrency`` lanes that pull from the
shared ``WorkQueue``: a worker that runs slow takes fewer items instead of
holding the round with a fixed share, and a worker that dies hands its items
in flight to the others. Calls are awaited as Ray ``ObjectRef``s, so the
event loop never blocks in ``ray.get``. Workers are killed at ``shutdown``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from omni_engine.sampling.base import BaseSampler, LaneLost, SamplerInitError
from omni_engine.sampling.config import SamplerConfig
from omni_engine.sampling.items import Response, SampleTask

logger = logging.getLogger(__name__)

class SamplingWorker:
    """A Ray actor holding one ``EngineSampler`` (async: its calls share the actor's event loop)."""

    def __init__(self, config: SamplerConfig, base_dir: str, env: dict[str, str]) -> None:
        # Ray sets OMP_NUM_THREADS in its workers; the stage processes inherit what is set here.
        os.environ.update(env)
        import msgspec

        from omni_engine.sampling.engine_sampler import EngineSampler

        engine_config = msgspec.structs.replace(config, kind="engine", num_workers=None, worker_resources=None,
                                                ray_address=None)
        self.sampler = EngineSampler(engine_config, base_dir=base_dir)

    async def start(self) -> dict[str, Any]:
        import ray

        await self.sampler.initialize()
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "model": self.sampler.model_name()}

    async def sample(self, task: SampleTask) -> list[Response]:
        return await self.sampler.sample(task, None)

    async def stop(self) -> None:
        await self.sampler.shutdown()


def worker_resources(config: SamplerConfig) -> dict[str, float]:
    """What one worker reserves: ``sampler.worker_resources``, else what a placed stage does (one CPU)."""
    from omni_engine.placement.ray_placement import DEFAULT_RESOURCES

    return dict(config.worker_resources) if config.worker_resources is not None else dict(DEFAULT_RESOURCES)


def workers_that_fit(total: dict[str, float], need: dict[str, float]) -> int:
    """How many workers needing ``need`` the cluster's ``total`` resources hold."""
    counts = [int(total.get(name, 0.0) // amount) for name, amount in need.items() if amount > 0]
    return min(counts) if counts else 0


class RaySampler(BaseSampler):
    kind = "ray"

    def __init__(self, config: SamplerConfig, *, base_dir: str = ".") -> None:
        super().__init__(config)
        self._base_dir = base_dir
        self._ray: Any = None
        self._owns_connection = False
        self.workers: list[Any] = []
        self.worker_info: list[dict[str, Any]] = []
        self.dead_workers: set[int] = set()

    async def initialize(self) -> None:
        import asyncio

        await super().initialize()

        try:
            import ray
        except ImportError:
            raise SamplerInitError("sampler.kind: ray needs Ray: pip install 'omni_engine[ray]'") from None
        self._ray = ray
        if not ray.is_initialized():
            address = None if self.config.ray_address in (None, "local") else self.config.ray_address
            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False, include_dashboard=False)
            except Exception as exc:  # noqa: BLE001 - re-raised naming the field
                raise SamplerInitError(f"sampler.ray_address: cannot join the Ray cluster at "
                                       f"{self.config.ray_address or 'a new local one'}: {exc}") from exc
            self._owns_connection = True
        need = worker_resources(self.config)
        fit = workers_that_fit(ray.cluster_resources(), need)
        count = self.config.num_workers or fit
        if count < 1 or count > fit:
            field = "sampler.num_workers" if self.config.num_workers else "sampler.worker_resources"
            raise SamplerInitError(f"{field}: {count or 'no'} worker(s) of {need} do not fit the Ray cluster "
                                   f"(it has {ray.cluster_resources()}; room for {fit})")
        options = self._actor_options(need)
        actor_class = ray.remote(SamplingWorker)
        self.workers = [actor_class.options(**options).remote(self.config, self._base_dir, self._worker_env(need))
                        for _ in range(count)]
        started = await asyncio.gather(*(w.start.remote() for w in self.workers), return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(started) if isinstance(r, BaseException)]
        if failed:
            i, exc = failed[0]
            raise SamplerInitError(f"sampler: Ray worker {i} of {count} failed to start its pipeline: "
                                   f"{getattr(exc, 'cause', None) or exc}")
        self.worker_info = list(started)
        logger.info("Ray sampler: %d workers ready (%s)", count, self.worker_info)

    def _actor_options(self, need: dict[str, float]) -> dict[str, Any]:
        from omni_engine.placement.ray_placement import actor_options

        # Each lane has one call in flight; a few more for start and stop.
        return {**actor_options(need), "max_concurrency": self.config.concurrency + 4}

    @staticmethod
    def _worker_env(need: dict[str, float]) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(max(1, int(need.get("CPU", 1)))),
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false")}

    def lanes(self) -> list[int]:
        # Interleaved, so the first tasks spread over every worker.
        live = [w for w in range(len(self.workers)) if w not in self.dead_workers]
        return [w for _ in range(self.config.concurrency) for w in live]

    async def sample(self, task: SampleTask, lane: int) -> list[Response]:
        ray = self._ray
        if lane in self.dead_workers:
            raise LaneLost(f"worker {lane} is dead")
        try:
            return await self.workers[lane].sample.remote(task)
        except ray.exceptions.RayActorError as exc:
            if lane not in self.dead_workers:
                self.dead_workers.add(lane)
                logger.error("Ray sampler: worker %d died (%s); %d left", lane, exc,
                             len(self.workers) - len(self.dead_workers))
            raise LaneLost(f"worker {lane} died") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
            raise RuntimeError(f"worker {lane}: {type(cause).__name__}: {cause}") from None

    def model_name(self) -> str:
        return self.worker_info[0]["model"] if self.worker_info else super().model_name()

    async def shutdown(self) -> None:
        import asyncio

        ray, workers, self.workers = self._ray, self.workers, []
        if ray is None:
            return
        if workers:
            # Stop the pipelines first (their stages exit cleanly), then kill the actors regardless.
            await asyncio.wait([asyncio.ensure_future(w.stop.remote()) for w in workers], timeout=30)
            for worker in workers:
                ray.kill(worker, no_restart=True)
        if self._owns_connection and ray.is_initialized():
            self._owns_connection = False
            ray.shutdown()
