"""Which client talks to one replica of a stage, and starting every stage of a pipeline.

A stage is a process of this host (``StageEngineCoreClient``), a process Ray
placed on some node (``RayStageClient``), or runs in this process, in a thread
of its own or on the client's event loop (``runtime.process: false``). All of
them speak the same messages; the config decides which one a replica gets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omni_engine.config import StageConfig
from omni_engine.pipeline.replica_set import StageReplicaSet
from omni_engine.stage_engine.base_client import BaseStageClient
from omni_engine.stage_engine.security import CurveKeys
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.stage_engine.stage_spec import StageProcessSpec

Progress = Callable[[str], None]


def zmq_stage_client(stage: StageConfig, spec: StageProcessSpec, replica: int, *, placement: Any = None,
                     curve: CurveKeys | None = None) -> StageEngineCoreClient:
    """The ZMQ client of ``replica`` of ``stage`` (``placement``: a ``RayPlacement``, or None)."""
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
    return StageEngineCoreClient(stage.stage_id, process=spec, transport=runtime.transport, host=runtime.host,
                                 curve=curve.for_new_process() if curve is not None else None)


def replica_set_for(stage: StageConfig, replicas: Sequence[BaseStageClient]) -> StageReplicaSet:
    """The replicas of ``stage`` as one stage client, balanced and failing over as configured."""
    runtime = stage.runtime
    capacity = runtime.max_batch_size or stage.engine_args.get("max_num_seqs") or 1
    return StageReplicaSet(stage.stage_id, replicas, load_balance=runtime.load_balance, affinity=runtime.affinity,
                           retry=runtime.retry, capacity=capacity)


async def start_stages(stage_sets: Mapping[int, StageReplicaSet], say: Progress) -> None:
    """Start every stage at once; if one fails, stop them all and raise its error."""

    async def start(stage_id: int) -> None:
        replicas = stage_sets[stage_id].replicas
        say(f"stage {stage_id}: starting {'process' if len(replicas) == 1 else f'{len(replicas)} replicas'}")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await stage_sets[stage_id].start()
        pids = ", ".join(str(r.ready.pid) for r in replicas)
        say(f"stage {stage_id}: ready in {loop.time() - t0:.1f} s (pid {pids})")

    results = await asyncio.gather(*(start(sid) for sid in stage_sets), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await asyncio.gather(*(s.shutdown() for s in stage_sets.values()), return_exceptions=True)
        raise errors[0]
