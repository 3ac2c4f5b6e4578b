"""Which client talks to one replica of a stage, and starting every stage of a pipeline.

A stage is a process of this host (``StageEngineCoreClient``), a process Ray
placed on some node (``RayStageClient``), or runs in this process, in a thread
of its own or on the client's event loop (``runtime.process: false``). All of
them speak the same messages; the config decides which one a replica gets.
``start_pipeline`` goes from a validated config to started stages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from omni_engine.config import PipelineConfig, StageConfig
from omni_engine.pipeline.replica_set import StageReplicaSet
from omni_engine.pipeline.stage_context import StageContext
from omni_engine.pipeline.stage_specs import build_stage_specs
from omni_engine.pipeline.stage_supervisor import DEFAULT_MAX_RESTARTS, RestartableStage, StageClientMaker
from omni_engine.stage_engine.security import CurveKeys
from omni_engine.stage_engine.stage_client import StageClient
from omni_engine.stage_engine.stage_launch import LaunchedStage
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.stage_engine.stage_spec import StageProcessSpec

Progress = Callable[[str], None]
# Builds the client of one replica from its config and process spec (default: ``zmq_stage_client``).
StageClientFactory = Callable[[StageConfig, StageProcessSpec], Any]


class Placement(Protocol):
    """Where a pipeline's stages run beyond this host (``RayPlacement``): released after the stages."""

    def close(self) -> None: ...


@dataclass
class StartedPipeline:
    """Every stage of a pipeline, started: what a ``MultiStageEngineClient`` is made of."""

    stages: list[StageContext]
    restartable: dict[int, RestartableStage]
    placement: Placement | None

    async def stop(self) -> None:
        """Stop every stage and release the placement (when what follows the start fails)."""
        await asyncio.gather(*(ctx.client.shutdown() for ctx in self.stages), return_exceptions=True)
        if self.placement is not None:
            self.placement.close()


async def start_pipeline(config: PipelineConfig, say: Progress,
                         make_stage_client: StageClientFactory | None = None,
                         launched: dict[int, LaunchedStage] | None = None) -> StartedPipeline:
    """Start every stage of a validated config whose models are prepared (``prepare_models``), in
    parallel, and connect. If one fails to start, every other is stopped and its error raised.
    ``launched``: stage processes already started (``early_launch``), adopted by their clients
    (each once: a later restart starts a new process)."""
    launched = dict(launched or {})
    specs = build_stage_specs(config)
    # CURVE on: one server keypair per run; each stage process its own keypair
    # unless the config fixes one (None: CURVE off).
    curve = config.runtime.security.curve_keys()
    placement = None
    if config.runtime.placement.backend == "ray":
        from omni_engine.placement.ray_placement import RayPlacement

        say("joining the Ray cluster")
        placement = RayPlacement(config.runtime.placement, config.stage_args)
        # A placed stage is reached over the network: always with CURVE.
        curve = curve or CurveKeys.generate()

    def make_client(stage: StageConfig, replica: int, spare: LaunchedStage | None = None) -> Any:
        spec = specs[stage.stage_id][replica]
        if make_stage_client is not None:
            return make_stage_client(stage, spec)
        early = spare or (launched.pop(stage.stage_id, None) if replica == 0 else None)
        return zmq_stage_client(stage, spec, replica, placement=placement, curve=curve, launched=early)

    def spare_spec(stage: StageConfig) -> StageProcessSpec | None:
        """What a warm spare of ``stage`` imports by (its first replica's spec; validation has kept
        warm_spare to local ipc stages without CURVE)."""
        wanted = stage.runtime.warm_spare and make_stage_client is None and placement is None and curve is None
        return specs[stage.stage_id][0] if wanted else None

    built = {stage.stage_id: stage_client_for(stage, len(specs[stage.stage_id]),
                                              lambda replica, spare=None, stage=stage: make_client(stage, replica,
                                                                                                   spare),
                                              spare_spec(stage))
             for stage in config.stage_args}
    clients = {sid: client for sid, (client, _) in built.items()}
    try:
        await start_stages(clients, say)
    except BaseException:
        if placement is not None:
            placement.close()
        raise
    contexts = [StageContext(stage.stage_id, stage, clients[stage.stage_id], stage.final_output,
                             stage.final_output_type or "text") for stage in config.stage_args]
    return StartedPipeline(contexts, {sid: r for sid, (_, r) in built.items() if r is not None}, placement)


def zmq_stage_client(stage: StageConfig, spec: StageProcessSpec, replica: int, *, placement: Any = None,
                     curve: CurveKeys | None = None, launched: LaunchedStage | None = None) -> StageEngineCoreClient:
    """The ZMQ client of ``replica`` of ``stage`` (``placement``: a ``RayPlacement``, or None;
    ``launched``: its process, already started)."""
    runtime = stage.runtime
    if not runtime.process:
        # Runs the stage's engine in this process: engine code is imported only then.
        from omni_engine.stage_engine.in_process import ClientLoopStageClient, InProcessStageClient

        in_process = ClientLoopStageClient if runtime.event_loop == "client" else InProcessStageClient
        return in_process(stage.stage_id, spec)
    if placement is not None:
        from omni_engine.placement.ray_stage_client import RayStageClient

        return RayStageClient(stage.stage_id, spec, placement=placement, replica=replica, curve=curve,
                              host=runtime.host)
    if launched is not None:
        return StageEngineCoreClient(stage.stage_id, process=spec, launched=launched)
    return StageEngineCoreClient(stage.stage_id, process=spec, transport=runtime.transport, host=runtime.host,
                                 curve=curve.for_new_process() if curve is not None else None)


def stage_client_for(stage: StageConfig, num_replicas: int, make_replica: StageClientMaker,
                     spare_spec: StageProcessSpec | None = None) -> tuple[StageClient, RestartableStage | None]:
    """The replicas of ``stage`` as one stage client, balanced and failing over as configured,
    and, under ``runtime.restart: on-failure``, what the supervisor needs to restart them
    (``spare_spec``: what its warm spare is started from, None: it has none)."""
    runtime = stage.runtime
    clients = [make_replica(r) for r in range(num_replicas)]
    if num_replicas == 1 and runtime.restart != "on-failure":
        # One replica, never replaced: nothing to choose, move or readmit, so the replica
        # layer would only add its bookkeeping to every request and output.
        return clients[0], None
    capacity = runtime.max_batch_size or stage.engine_args.get("max_num_seqs") or 1
    replicas = StageReplicaSet(stage.stage_id, clients, load_balance=runtime.load_balance, affinity=runtime.affinity,
                               retry=runtime.retry, capacity=capacity)
    if runtime.restart != "on-failure":
        return replicas, None
    limit = DEFAULT_MAX_RESTARTS if runtime.max_restarts is None else runtime.max_restarts
    return replicas, RestartableStage(replicas, make_replica, limit, spare_spec)


async def start_stages(clients: Mapping[int, StageClient], say: Progress) -> None:
    """Start every stage at once; if one fails, stop them all and raise its error."""

    async def start(stage_id: int) -> None:
        client = clients[stage_id]
        n = len(client.replica_status())
        if getattr(client, "launched", None) is not None:
            say(f"stage {stage_id}: connecting to its process")
        else:
            say(f"stage {stage_id}: starting {'process' if n == 1 else f'{n} replicas'}")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await client.start()
        pids = ", ".join(str(status.pid) for status in client.replica_status())
        say(f"stage {stage_id}: ready in {loop.time() - t0:.1f} s (pid {pids})")

    results = await asyncio.gather(*(start(sid) for sid in clients), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await asyncio.gather(*(c.shutdown() for c in clients.values()), return_exceptions=True)
        raise errors[0]
