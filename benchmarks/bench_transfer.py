#!/usr/bin/env python
"""Tensors from stage A to stage B through the client: new vs legacy architecture.

    python benchmarks/bench_transfer.py [--quick] [--max-size 256M]

One two-stage pipeline per path, all running at once: stage A (a generation
stage) makes a new uint8 tensor of N bytes per request, the orchestrator
forwards it to stage B, which notes when it got it. The transfer time is
B's receipt minus A's making (``time.monotonic`` is one clock for every
process), so it holds everything a transfer costs (A's encoding, both hops,
the client's routing, B's decoding) and nothing else. Paths:

* ``new shm``: the new architecture as configured by default (ZMQ;
  tensors >= 1 MiB as shared-memory handles, zero-copy through the client);
* ``new into slot``: the same, with stage A writing its tensor straight into
  a slot of its shared-memory pool (``omni_engine.connectors.shm.empty_output``),
  so not even the one copy into shared memory is made;
* ``new frames``: the new architecture with ``use_shm: false`` (ZMQ frames);
* ``legacy``: ``multiprocessing.Queue`` with pickle (torch moves a tensor's
  storage into shared memory and passes its file descriptor);
* ``memcpy``: in-process copy of the same bytes, the bound.

Sizes are interleaved (one request per path in turn) so that noise from
other work on the machine hits every path alike. Writes JSON and a PNG to
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    RESULTS,
    MiB,
    fmt_size,
    machine_info,
    memcpy_gbps,
    new_figure,
    num,
    progress,
    save_figure,
    write_json,
)

SIZES = [1 << 10, 16 << 10, 256 << 10, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
# path -> (pipeline it runs on, extra prompt fields)
PATHS = {
    "new shm": ("new shm", {}),
    "new into slot": ("new shm", {"into_slot": True}),
    "new frames": ("new frames", {}),
    "legacy": ("legacy", {}),
}


def pipeline_config(use_shm: bool) -> Any:
    from omni_engine.config import parse_pipeline_config

    return parse_pipeline_config({
        "runtime": {"connectors": {"use_shm": use_shm}},
        "stage_args": [
            {"stage_id": 0, "stage_type": "generation",
             "engine_args": {"model_factory": "benchmarks.bench_models:make_fresh_tensor_source"}},
            {"stage_id": 1, "stage_type": "generation", "engine_input_source": [0],
             "engine_args": {"model_factory": "benchmarks.bench_models:make_tensor_sink"},
             "custom_process_input_func": "benchmarks.bench_models:ForwardStampedTensor",
             "final_output": True, "final_output_type": "tensor"},
        ],
    }, "<bench_transfer>")


async def start_paths() -> dict[str, Any]:
    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
    from omni_engine.legacy import start_legacy_pipeline

    new_shm, new_frames, legacy = await asyncio.gather(
        MultiStageEngineClient.from_config(pipeline_config(True)),
        MultiStageEngineClient.from_config(pipeline_config(False)),
        start_legacy_pipeline(pipeline_config(True)),
    )
    return {"new shm": new_shm, "new frames": new_frames, "legacy": legacy}


async def transfer_once(client: Any, nbytes: int, request_id: str, extra: dict | None = None) -> float:
    """Seconds from A making the tensor to B having it; checks the bytes arrived."""
    result = None
    async for out in client.generate({"nbytes": nbytes, **(extra or {})}, None, request_id):
        if out.multimodal_output:
            result = out.multimodal_output
    if result is None or not result["ok"] or result["nbytes"] != nbytes:
        raise AssertionError(f"{request_id}: wrong result {result}")
    return result["received_at"] - result["made_at"]


def reps_for(size: int, quick: bool) -> int:
    budget = (256 if quick else 1024) * MiB
    return int(max(3 if quick else 5, min(30 if quick else 100, budget // size)))


async def measure(clients: dict[str, Any], sizes: list[int], quick: bool) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        reps = reps_for(size, quick)
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        for w in range(3):  # warm-up: pools reach their steady size, pages are touched, imports done
            for p, (pipeline, extra) in PATHS.items():
                await transfer_once(clients[pipeline], size, f"warm{w}-{p}-{size}", extra)
        for i in range(reps):
            for p, (pipeline, extra) in PATHS.items():
                times[p].append(await transfer_once(clients[pipeline], size, f"{p}-{size}-{i}", extra))
        bound = memcpy_gbps(size, 512 * MiB)["numpy"]
        row: dict[str, Any] = {"size": size, "reps": reps, "memcpy_gbps": bound}
        for p in PATHS:
            med = statistics.median(times[p])
            row[p] = {"median_s": med, "p90_s": sorted(times[p])[int(0.9 * (len(times[p]) - 1))],
                      "gbps": size / med / 1e9, "x_memcpy": size / med / 1e9 / bound}
        rows.append(row)
        progress(f"  {fmt_size(size):>5}: " + "  ".join(f"{p} {row[p]['gbps']:.3g} GB/s" for p in PATHS)
                 + f"  memcpy {bound:.3g} GB/s")
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\nTensor stage A -> client -> stage B, GB/s (x = ratio to in-process memcpy of the same bytes)")
    head = f"{'size':>6}{'reps':>6}{'memcpy':>8} |" + "".join(f"{p:>19} |" for p in PATHS)
    print(head + f"{'shm/legacy':>12}{'slot/legacy':>12}{'frames/legacy':>14}")
    for r in rows:
        cells = "".join(f"{num(r[p]['gbps']):>10}{num(r[p]['x_memcpy']):>8} |" for p in PATHS)
        print(f"{fmt_size(r['size']):>6}{r['reps']:>6}{num(r['memcpy_gbps']):>8} |{cells}"
              f"{r['new shm']['gbps'] / r['legacy']['gbps']:>12.2f}"
              f"{r['new into slot']['gbps'] / r['legacy']['gbps']:>12.2f}"
              f"{r['new frames']['gbps'] / r['legacy']['gbps']:>14.2f}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, (ax, ax_ratio) = new_figure(2)
    sizes = [r["size"] for r in rows]
    for p in PATHS:
        ax.plot(sizes, [r[p]["gbps"] for r in rows], marker="o", label=p)
    ax.plot(sizes, [r["memcpy_gbps"] for r in rows], linestyle="--", color="gray", label="memcpy bound")
    ax.set(xscale="log", yscale="log", xlabel="tensor bytes", ylabel="GB/s", title="stage A -> B through the client")
    ax.legend()
    for p in ("new shm", "new into slot", "new frames"):
        ax_ratio.plot(sizes, [r[p]["gbps"] / r["legacy"]["gbps"] for r in rows], marker="o", label=f"{p} / legacy")
    ax_ratio.axhline(1.0, color="gray", linewidth=0.8)
    ax_ratio.axhline(5.0, color="red", linewidth=0.8, linestyle=":", label="target 5x (>= 16 MiB)")
    ax_ratio.set(xscale="log", yscale="log", xlabel="tensor bytes", ylabel="x legacy", title="new vs legacy")
    ax_ratio.legend()
    save_figure(fig, path)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [s for s in SIZES if args.min_size <= s <= args.max_size]
    progress("starting 3 two-stage pipelines (new with shm, new with frames, legacy) ...")
    clients = await start_paths()
    try:
        rows = await measure(clients, sizes, args.quick)
    finally:
        await asyncio.gather(*(c.shutdown_async() for c in clients.values()))
    return {"benchmark": "bench_transfer", "machine": machine_info(), "quick": args.quick, "rows": rows}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--min-size", type=parse_size, default=1 << 10, help="smallest tensor (default 1K)")
    ap.add_argument("--max-size", type=parse_size, default=256 * MiB, help="largest tensor (default 256M)")
    ap.add_argument("--out", default=str(RESULTS / "bench_transfer"), help="path prefix for .json and .png")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    res = asyncio.run(main_async(args))
    res["total_seconds"] = round(time.perf_counter() - t0, 1)
    print_table(res["rows"])
    write_json(f"{args.out}.json", res)
    plot(res["rows"], Path(f"{args.out}.png"))


if __name__ == "__main__":
    main()
