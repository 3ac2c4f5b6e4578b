#!/usr/bin/env python
"""A stage placed through Ray: what placement costs, and how fast its failures are found.

    python benchmarks/bench_ray_placement.py [--requests 20] [--rounds 3]

On a two-node ``ray.cluster_utils.Cluster`` on this machine (node B has the
custom resource ``node_b``), a speech stage placed on node B against the same
stage as a local process, in one run:

* start: from ``from_config`` to ready (placement, launcher, keypair, process);
* round trip of a short speech request, p50, placed (tcp + CURVE, frames) vs
  local (ipc, shared memory): the ratio is what the network path costs here;
* failures, each repeated ``--rounds`` times with ``restart: on-failure``:
  ``kill -9`` of the stage (the launcher reports the exit), ``SIGSTOP`` (only
  heartbeats tell) and the loss of node B (a new node with ``node_b`` takes
  the stage): seconds to eviction and to the stage serving again.

Writes JSON to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import RESULTS, machine_info, progress, write_json  # noqa: E402
from omni_engine.config import parse_pipeline_config  # noqa: E402
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient  # noqa: E402

TTS_FACTORY = "omni_engine.engines.tts:make_espeak_tts"
TEXT = "A short sentence."
NODE_ARGS = dict(num_cpus=2, object_store_memory=80 << 20)


def speech(address: str | None):
    runtime: dict[str, Any] = {}
    stage_runtime: dict[str, Any] = {"max_batch_size": 1, "restart": "on-failure", "max_restarts": 100}
    if address is not None:
        runtime["placement"] = {"backend": "ray", "address": address}
        stage_runtime["resources"] = {"node_b": 1}
    return parse_pipeline_config({"runtime": runtime, "stage_args": [{
        "stage_id": 0, "stage_type": "generation", "engine_args": {"model_factory": TTS_FACTORY},
        "runtime": stage_runtime, "final_output": True, "final_output_type": "audio"}]}, "<bench_ray_placement>")


async def speak(client, request_id: str) -> None:
    async for _ in client.generate(TEXT, None, request_id):
        pass


async def round_trips(client, n: int, tag: str) -> float:
    """p50 seconds of ``n`` sequential requests (after one warm-up)."""
    await speak(client, f"{tag}-warm")
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        await speak(client, f"{tag}-{i}")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def until(predicate, timeout: float = 120.0) -> float:
    start = time.perf_counter()
    while not predicate():
        if time.perf_counter() - start > timeout:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.005)
    return time.perf_counter() - start


async def failure(client, cluster, kind: str) -> tuple[float, float]:
    """(seconds to eviction, seconds from the event to the next request served)."""
    stage = client.stage_contexts[0].client.replicas[0]
    start = time.perf_counter()
    if kind == "kill":
        os.kill(stage.ready.pid, signal.SIGKILL)
    elif kind == "freeze":
        os.kill(stage.ready.pid, signal.SIGSTOP)
    else:
        cluster.remove_node(cluster.node_b)
    evicted = await until(lambda: not client.replica_alive(0, 0))
    if kind == "node":
        cluster.node_b = cluster.add_node(**NODE_ARGS, resources={"node_b": 1})
    await until(lambda: client.replica_alive(0, 0))
    await speak(client, f"after-{kind}-{time.perf_counter()}")
    return evicted, time.perf_counter() - start


def summary(values: list[float]) -> dict[str, float]:
    return {"p50_s": round(statistics.median(values), 3), "max_s": round(max(values), 3)}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args=dict(NODE_ARGS, resources={"node_a": 1}, include_dashboard=False))
    cluster.node_b = cluster.add_node(**NODE_ARGS, resources={"node_b": 1})
    res: dict[str, Any] = {"machine": machine_info(), "requests": args.requests, "rounds": args.rounds}
    try:
        t0 = time.perf_counter()
        local = await MultiStageEngineClient.from_config(speech(None))
        res["start_local_s"] = round(time.perf_counter() - t0, 2)
        try:
            local_p50 = await round_trips(local, args.requests, "local")
        finally:
            await local.shutdown_async()
        t0 = time.perf_counter()
        placed = await MultiStageEngineClient.from_config(speech(cluster.address))
        res["start_placed_s"] = round(time.perf_counter() - t0, 2)
        try:
            placed_p50 = await round_trips(placed, args.requests, "placed")
            res["round_trip_p50_ms"] = {"local": round(local_p50 * 1e3, 2), "placed": round(placed_p50 * 1e3, 2),
                                        "placed_over_local": round(placed_p50 / local_p50, 2)}
            progress(f"round trip p50: local {local_p50 * 1e3:.1f} ms, placed {placed_p50 * 1e3:.1f} ms")
            for kind in ("kill", "freeze", "node"):
                evictions, served = [], []
                for _ in range(args.rounds):
                    evicted, back = await failure(placed, cluster, kind)
                    evictions.append(evicted)
                    served.append(back)
                    progress(f"{kind}: evicted after {evicted:.3f} s, serving again after {back:.1f} s")
                res[kind] = {"evicted": summary(evictions), "served_again": summary(served)}
        finally:
            await placed.shutdown_async()
    finally:
        cluster.shutdown()
    return res


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    results = asyncio.run(main(parser.parse_args()))
    write_json(RESULTS / "bench_ray_placement.json", results)
    print(results)
