"""``RayPlacement``: a pipeline's hold on a Ray cluster (``runtime.placement.backend: ray``).

One placement group per placed stage, one bundle per replica (the stage's
``runtime.resources``, laid out by its ``runtime.strategy``): the cluster
reserves a stage's replicas together, and when a node is lost Ray places
its bundles again where resources allow, so a restarted replica comes back
there. In each bundle a ``StageLauncher`` actor runs the replica's process.

Ray carries only control calls (start, stop, exit, public keys); requests
and outputs travel over the stages' own ZMQ sockets. Ray is imported here
only, and only when a config asks for it.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any

from omni_engine.config import PlacementConfig, StageConfig
from omni_engine.placement.stage_launcher import StageLauncher

logger = logging.getLogger(__name__)

DEFAULT_RESOURCES = {"CPU": 1.0}
DEFAULT_STRATEGY = "PACK"
# Concurrent calls a launcher takes: wait_exit blocks for the process's life, stop and log_tail come meanwhile.
_LAUNCHER_CONCURRENCY = 4


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("runtime.placement.backend: ray needs Ray: pip install 'omni_engine[ray]'") from None
    return ray


def stage_resources(stage: StageConfig) -> dict[str, float]:
    """What one replica of ``stage`` reserves (its ``runtime.resources``, default one CPU)."""
    return dict(stage.runtime.resources) if stage.runtime.resources is not None else dict(DEFAULT_RESOURCES)


def actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """``resources`` as Ray actor options: CPU, GPU and memory have options of their own."""
    rest = dict(resources)
    options = dict(num_cpus=rest.pop("CPU", 0), num_gpus=rest.pop("GPU", 0))
    if "memory" in rest:
        options["memory"] = rest.pop("memory")
    return {**options, "resources": rest}


class RayStageGroup:
    """One stage's placement group and the launchers of its replicas."""

    def __init__(self, ray: Any, stage: StageConfig, run_name: str) -> None:
        from ray.util.placement_group import placement_group

        self._ray = ray
        self.stage_id = stage.stage_id
        self.resources = stage_resources(stage)
        self.strategy = stage.runtime.strategy or DEFAULT_STRATEGY
        self.group = placement_group([dict(self.resources)] * stage.runtime.num_replicas, strategy=self.strategy,
                                     name=f"{run_name}-stage{stage.stage_id}")
        self._launcher_class = ray.remote(StageLauncher)

    def launcher(self, replica: int) -> Any:
        """A new launcher actor in the replica's bundle (Ray creates it once the bundle is placed)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=replica)
        return self._launcher_class.options(
            max_concurrency=_LAUNCHER_CONCURRENCY, scheduling_strategy=strategy,
            **actor_options(self.resources)).remote()

    def describe_wait(self) -> str:
        """Why a launcher may not have started: the group's state and what the cluster has free."""
        from ray.util.placement_group import placement_group_table

        state = placement_group_table(self.group).get("state", "?")
        # Without Ray's bookkeeping entries (per-node and per-group pseudo-resources).
        free = {name: amount for name, amount in self._ray.available_resources().items()
                if not name.startswith(("node:", "bundle_group_"))}
        return (f"Ray has not placed replica bundles of {self.resources} (strategy {self.strategy}; placement group "
                f"{state}); resources free in the cluster: {free}")

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)  # its actors (the launchers) go with it
        except Exception:  # noqa: BLE001 - the cluster may be gone already
            logger.debug("stage %d: placement group not removed", self.stage_id, exc_info=True)


class RayPlacement:
    """The cluster this pipeline's placed stages run in (joined at start, left at shutdown)."""

    def __init__(self, config: PlacementConfig, stages: list[StageConfig]) -> None:
        ray = self._ray = import_ray()
        # A process already connected (a Ray job, a test) keeps its connection; else we join and leave.
        self._owns_connection = not ray.is_initialized()
        if self._owns_connection:
            address = None if config.address in (None, "auto") else config.address
            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            except Exception as exc:  # noqa: BLE001 - re-raised naming the field
                raise RuntimeError(f"runtime.placement: cannot join the Ray cluster at "
                                   f"{config.address or 'auto'}: {exc}") from exc
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.node_ip: str = ray.util.get_node_ip_address()
        # Group names are unique per job: two pipelines in one process must not collide.
        run_name = f"omni-{os.getpid()}-{secrets.token_hex(4)}"
        self.groups = {stage.stage_id: RayStageGroup(ray, stage, run_name) for stage in stages if stage.runtime.process}
        logger.info("Ray placement: client on node %s (%s); stages %s placed through Ray", self.node_id,
                    self.node_ip, sorted(self.groups))

    @property
    def ray(self) -> Any:
        return self._ray

    def close(self) -> None:
        """Remove the placement groups (and launchers); leave the cluster if we joined it. Idempotent."""
        groups, self.groups = self.groups, {}
        for group in groups.values():
            group.remove()
        if self._owns_connection and self._ray.is_initialized():
            self._owns_connection = False
            self._ray.shutdown()
