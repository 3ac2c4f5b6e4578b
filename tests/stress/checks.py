"""After a stress run: is any request state, lease or segment left anywhere?

Each check returns a list of violations (strings naming the stage and what it
still holds); empty means clean. Cleanup after an abort is asynchronous (the
ABORT message travels to the stage, shared-memory releases are batched on
the loop), so ``wait_clean`` polls until clean or a timeout.
"""

from __future__ import annotations

import asyncio
import gc

from omni_engine.connectors.shm import list_segments
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from tests.helpers import group_members
from tests.stress.pipeline import is_legacy


def replica_clients(stage_client) -> list:
    """The clients of every replica of a stage (a stage built by hand is one)."""
    return list(getattr(stage_client, "replicas", [stage_client]))


def client_side(client: MultiStageEngineClient) -> list[str]:
    """State held in the client process: orchestrator, stage clients, lease book."""
    orch = client.orchestrator
    found = []
    if orch.num_requests:
        found.append(f"orchestrator holds {orch.num_requests} request(s): {orch.request_ids()[:5]}")
    counts = orch.state_counts()
    if counts["routes"]:
        found.append(f"orchestrator routes {counts['routes']} sub-request(s)")
    if counts["readers"]:
        found.append("idle orchestrator still has reader tasks")
    for ctx in client.stage_contexts:
        counts = ctx.client.state_counts()
        if any(counts.values()):
            found.append(f"stage {ctx.stage_id} client holds {counts}")
    books = {id(b): b for ctx in client.stage_contexts for replica in replica_clients(ctx.client)
             if (b := getattr(replica, "lease_book", None)) is not None}
    for book in books.values():
        if book.num_tracked():
            found.append(f"lease book tracks {book.num_tracked()} shared-memory slot(s)")
    return found


async def stage_side(client: MultiStageEngineClient) -> list[str]:
    """State held in the stage processes: unfinished requests, leased shm slots."""
    found = []
    for ctx in client.stage_contexts:
        counts = await ctx.client.call_each_replica_async("num_unfinished_requests", call_timeout=10)
        for replica, n in counts.items():
            if n:
                found.append(f"stage {ctx.stage_id} replica {replica} process reports {n} unfinished request(s)")
        if not is_legacy(client):
            stats = await ctx.client.call_each_replica_async("shm_stats", call_timeout=10)
            for replica, stat in stats.items():
                if stat["leased"]:
                    found.append(f"stage {ctx.stage_id} replica {replica} shm pool has {stat['leased']} "
                                 "leased slot(s)")
    return found


async def wait_clean(client: MultiStageEngineClient, timeout: float = 15.0) -> list[str]:
    """Poll until neither the client nor any stage holds request state; the violations left at ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        gc.collect()  # outputs dropped by the caller free their shm views now, not at the next GC
        await asyncio.sleep(0)  # let the lease book's batched releases go out
        found = client_side(client) + await stage_side(client)
        if not found or loop.time() > deadline:
            return found
        await asyncio.sleep(0.1)


async def after_shutdown(client: MultiStageEngineClient, timeout: float = 5.0) -> list[str]:
    """After ``shutdown_async``: no stage process, process group, socket dir or segment of this pipeline.

    Polls up to ``timeout``: SIGKILL of a process group is delivered asynchronously.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (found := _left_after_shutdown(client)) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return found


def _left_after_shutdown(client: MultiStageEngineClient) -> list[str]:
    found = []
    for ctx in client.stage_contexts:
        for stage in replica_clients(ctx.client):
            found += _left_of_replica(ctx.stage_id, stage)
    return found


def _left_of_replica(stage_id: int, stage) -> list[str]:
    """What one stage replica's client left: its process (group), socket dir, segments."""
    found = []
    if stage.process is not None:
        if stage.process.is_alive():
            found.append(f"stage {stage_id} process {stage.process.pid} is alive")
        members = group_members(stage.process.pid)
        if members:
            found.append(f"stage {stage_id} process group still has {members}")
    runtime_dir = getattr(stage, "runtime_dir", None)
    if runtime_dir is not None and runtime_dir.exists():
        found.append(f"stage {stage_id} socket dir {runtime_dir} remains")
    prefix = getattr(stage, "shm_prefix", None)
    if prefix is not None and list_segments(prefix):
        found.append(f"stage {stage_id} segments remain: {list_segments(prefix)[:5]}")
    return found
