#!/usr/bin/env python
"""CPU used by an idle pipeline: the client process and every stage process.

    python benchmarks/bench_idle.py [--seconds 10] [--config stage_configs/smollm2_speech.yaml]

Starts the pipeline on each architecture in turn, serves one request (so
every lazily started task has run), then reads ``/proc/<pid>/stat`` of the
client (this process), each stage process and each stage's children (vLLM's
EngineCore) before and after ``--seconds`` of idling. An idle pipeline
should cost nothing: nothing in omni_engine polls. Writes JSON and a PNG to
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    RESULTS,
    machine_info,
    new_figure,
    progress,
    save_figure,
    write_json,
)
from tests.stress.rss import cpu_snapshot  # noqa: E402  (one /proc reader for the soak and this)


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def watched_processes(client: Any) -> dict[str, int]:
    procs = {"client": os.getpid()}
    for ctx in client.stage_contexts:
        pid = ctx.client.process.pid
        procs[f"stage {ctx.stage_id}"] = pid
        for child in children(pid):
            procs[f"stage {ctx.stage_id} child {process_name(child)}"] = child
    return procs


async def idle_cpu(client: Any, seconds: float) -> dict[str, float]:
    procs = watched_processes(client)
    before = cpu_snapshot(procs)
    t0 = time.monotonic()
    await asyncio.sleep(seconds)  # the client's own loop is idle meanwhile
    wall = time.monotonic() - t0
    after = cpu_snapshot(procs)
    return {name: round(100 * (after[name] - before[name]) / wall, 3)
            for name in procs if before[name] is not None and after[name] is not None}


async def one_request(client: Any, config: Any) -> None:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=16) if s.stage_type == "llm" else None
              for s in config.stage_args]
    async for _ in client.generate("Say hello.", params, f"warm-{time.monotonic_ns()}"):
        pass


async def measure(arch: str, config: Any, seconds: float) -> dict[str, float]:
    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
    from omni_engine.legacy import start_legacy_pipeline

    start = MultiStageEngineClient.from_config if arch == "new" else start_legacy_pipeline
    client = await start(config)
    try:
        await one_request(client, config)
        await client.orchestrator.wait_idle()
        return await idle_cpu(client, seconds)
    finally:
        await client.shutdown_async()


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    fig, (ax,) = new_figure(1, width=8)
    names = sorted({n for r in results.values() for n in r})
    width = 0.8 / len(results)
    for i, (arch, cpu) in enumerate(results.items()):
        ax.bar([j + i * width for j in range(len(names))], [cpu.get(n, 0.0) for n in names], width, label=arch)
    ax.axhline(1.0, color="red", linestyle=":", linewidth=0.8, label="client target < 1 %")
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(names))], names, rotation=20, ha="right")
    ax.set(ylabel="% of one CPU while idle", title="idle pipeline CPU")
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--config", default="stage_configs/smollm2_speech.yaml")
    ap.add_argument("--out", default=str(RESULTS / "bench_idle"), help="path prefix for .json and .png")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from omni_engine.config import load_pipeline_config

    config = load_pipeline_config(args.config)
    results = {}
    for arch in ("new", "legacy"):
        progress(f"{arch}: starting {args.config}, one request, then {args.seconds:.0f} s idle ...")
        results[arch] = asyncio.run(measure(arch, config, args.seconds))
    print(f"\nCPU while idle for {args.seconds:.0f} s, % of one core")
    names = sorted({n for r in results.values() for n in r})
    print(f"{'process':<34}" + "".join(f"{a:>10}" for a in results))
    for n in names:
        print(f"{n:<34}" + "".join(f"{results[a].get(n, float('nan')):>10.2f}" for a in results))
    write_json(f"{args.out}.json", {"benchmark": "bench_idle", "machine": machine_info(), "seconds": args.seconds,
                                    "config": args.config, "cpu_percent": results})
    plot(results, Path(f"{args.out}.png"))


if __name__ == "__main__":
    main()
