#!/usr/bin/env python
"""Stage replicas: throughput with 1 vs N replicas, and how long a replica's death costs.

    python benchmarks/bench_replicas.py [--requests 48] [--failovers 5]

Three measurements, each a ratio within one run (these machines are shared):

* speech: a speech-only pipeline (eSpeak NG, CPU-bound) at concurrency 8,
  1 vs 2 replicas (target >= 1.6x on 2 cores);
* waiting: a generation stage whose model only waits (0.2 s per batch, batch
  size 1, no CPU) at concurrency 16, 1 vs 4 replicas (target >= 3.5x);
* failover: 2 speech replicas under load; ``kill -9`` of one, then the time
  to the eviction and to the next request served; repeated, p50 and max.

Writes JSON and a PNG to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    RESULTS,
    machine_info,
    new_figure,
    pct,
    progress,
    save_figure,
    write_json,
)
from omni_engine.config import parse_pipeline_config  # noqa: E402
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient  # noqa: E402

TTS_FACTORY = "omni_engine.engines.tts:make_espeak_tts"
TEXT = " ".join(["The quick brown fox jumps over the lazy dog near the quiet river bank."] * 6)


def one_stage(engine_args: dict, **runtime: Any):
    return parse_pipeline_config({"stage_args": [{
        "stage_id": 0, "stage_type": "generation", "engine_args": engine_args,
        "runtime": {"max_batch_size": 1, **runtime}, "final_output": True, "final_output_type": "audio",
    }]}, "<bench_replicas>")


def speech(replicas: int, **runtime: Any):
    return one_stage({"model_factory": TTS_FACTORY}, num_replicas=replicas, **runtime)


def waiting(replicas: int):
    return one_stage({"model_factory": "tests.models:make_pid_probe", "delay": 0.2}, num_replicas=replicas)


async def run_one(client: MultiStageEngineClient, prompt: Any, request_id: str) -> None:
    async for _ in client.generate(prompt, None, request_id):
        pass


async def throughput(config, prompt: Any, requests: int, concurrency: int) -> float:
    """Requests per second at ``concurrency`` (after one warm-up request per replica)."""
    async with await MultiStageEngineClient.from_config(config) as client:
        n = len(client.replica_status(0))
        await asyncio.gather(*(run_one(client, prompt, f"warm-{i}") for i in range(n)))
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)

        async def worker() -> None:
            while not queue.empty():
                await run_one(client, prompt, f"r{queue.get_nowait()}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return requests / (time.perf_counter() - t0)


async def failover(trials: int) -> dict[str, list[float]]:
    """Per trial: seconds from ``kill -9`` of replica 0 to its eviction and to the next request served."""
    found: dict[str, list[float]] = {"evicted_s": [], "next_served_s": []}
    async with await MultiStageEngineClient.from_config(speech(2, restart="on-failure", max_restarts=trials)) as client:
        served: list[float] = []
        stop = asyncio.Event()

        async def load(k: int) -> None:
            i = 0
            while not stop.is_set():
                await run_one(client, TEXT, f"load{k}-{i}")
                served.append(time.perf_counter())
                i += 1

        workers = [asyncio.ensure_future(load(k)) for k in range(4)]
        for trial in range(trials):
            await asyncio.sleep(0.5)
            pid = client.replica_status(0)[0].pid
            t_kill = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            while client.replica_status(0)[0].alive:
                await asyncio.sleep(0.001)
            found["evicted_s"].append(time.perf_counter() - t_kill)
            while not any(t > t_kill for t in served):
                await asyncio.sleep(0.001)
            found["next_served_s"].append(min(t for t in served if t > t_kill) - t_kill)
            progress(f"failover {trial + 1}/{trials}: evicted in {found['evicted_s'][-1] * 1e3:.1f} ms, next "
                     f"served after {found['next_served_s'][-1] * 1e3:.1f} ms")
            while not (client.replica_status(0)[0].alive and client.replica_status(0)[0].pid != pid):
                await asyncio.sleep(0.05)  # restarted
        stop.set()
        await asyncio.gather(*workers)
    return found


async def main(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, config, prompt, n, concurrency in (
            ("speech", speech, TEXT, 2, 8),
            ("waiting", waiting, {"index": 0}, 4, 16)):
        one = await throughput(config(1), prompt, args.requests, concurrency)
        many = await throughput(config(n), prompt, args.requests, concurrency)
        results[name] = {"replicas": n, "concurrency": concurrency, "rps_1": one, f"rps_{n}": many,
                         "ratio": many / one}
        progress(f"{name}: 1 replica {one:.2f} req/s, {n} replicas {many:.2f} req/s: {many / one:.2f}x")
    times = await failover(args.failovers)
    results["failover"] = {key: {"p50_ms": pct(v, 50) * 1e3, "max_ms": max(v) * 1e3, "all_ms": [x * 1e3 for x in v]}
                           for key, v in times.items()}
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    fig, (ax1, ax2) = new_figure(2, width=10)
    names = ["speech", "waiting"]
    ratios = [results[n]["ratio"] for n in names]
    ax1.bar([f"{n}\n1 vs {results[n]['replicas']}" for n in names], ratios, color=["#4c72b0", "#55a868"])
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_ylabel("throughput ratio (N replicas / 1)")
    for i, r in enumerate(ratios):
        ax1.text(i, r, f"{r:.2f}x", ha="center", va="bottom")
    fo = results["failover"]
    keys = ["evicted_s", "next_served_s"]
    ax2.bar([k.replace("_s", "") + " p50" for k in keys], [fo[k]["p50_ms"] for k in keys], color="#c44e52")
    ax2.bar([k.replace("_s", "") + " max" for k in keys], [fo[k]["max_ms"] for k in keys], color="#dd8452")
    ax2.set_ylabel("ms after kill -9 of a replica")
    save_figure(fig, path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--failovers", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "bench_replicas"))
    args = parser.parse_args()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    results = run(main(args))
    write_json(f"{args.out}.json", {"benchmark": "bench_replicas", "machine": machine_info(), **results})
    plot(results, Path(f"{args.out}.png"))
    print(results)
