"""Full pushes of SmolLM2-135M (float32, ~540 MB) into a running one-stage pipeline, fence included.

    python benchmarks/bench_weight_update.py [--pushes 5] [--backends shm zmq] [--mode wait]

Per backend: the fenced push (pause, transfer, check on every replica, commit, prefix-cache
reset, resume) end to end, and its phases; the transfer's GB/s against an in-process memcpy
of the same bytes in the same run. Meanwhile a background load (``--load`` concurrent
streams) runs; its request latency p50/p99 is reported for requests that overlapped an
update and for those that did not. The first push of a backend pays first-touch page
faults (buffers, store files): it is reported apart and left out of the steady figures.
Target: shm push <= 2 s on this CPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from bench_common import RESULTS, machine_info, memcpy_gbps, pct, progress, write_json

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


async def run(args: argparse.Namespace) -> dict:
    import torch
    from safetensors.torch import load_file
    from vllm import SamplingParams

    from omni_engine.config import parse_pipeline_config
    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
    from omni_engine.models.prepare import prepare_model
    from omni_engine.weights.sender import WeightSender
    from tests.helpers import llm_engine_args

    model = prepare_model("smollm2", progress=progress)
    state = {name: t.float() for name, t in load_file(next(model.glob("*.safetensors"))).items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    config = parse_pipeline_config({"stage_args": [{
        "stage_id": 0, "stage_type": "llm", "engine_args": llm_engine_args(model), "final_output": True,
        "final_output_type": "text"}], "weights": {"backend": args.backends[0]}})
    progress("starting the pipeline")
    client = await MultiStageEngineClient.from_config(config)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a short story about a cat."}],
                                           tokenize=False, add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    latencies: list[tuple[float, float]] = []  # (start, end)
    windows: list[tuple[float, float]] = []  # updates
    stop = asyncio.Event()

    async def stream(k: int) -> None:
        n = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            async for _ in client.generate(prompt, params, f"load-{k}-{n}"):
                pass
            latencies.append((t0, time.perf_counter()))
            n += 1

    results: dict = {"bytes": nbytes, "tensors": len(state), "memcpy_gbps": memcpy_gbps(64 << 20, 1 << 30),
                     "backends": {}}
    version = 0
    load = [asyncio.create_task(stream(k)) for k in range(args.load)]
    try:
        await asyncio.sleep(3.0)
        for backend in args.backends:
            with WeightSender(backend) as sender:
                await client.init_weight_transfer_engine(sender.init_info())
                pushes = []
                for i in range(args.pushes + 1):
                    version += 1
                    t0 = time.perf_counter()
                    await sender.push_async(client, state, str(version), mode=args.mode)
                    t1 = time.perf_counter()
                    windows.append((t0, t1))
                    pushes.append({"total_s": t1 - t0, **client.weights.timings})
                    progress(f"{backend} push {i}: {t1 - t0:.3f} s {client.weights.timings}")
                    await asyncio.sleep(args.gap)
            steady = pushes[1:]
            mean = {k: sum(p[k] for p in steady) / len(steady) for k in steady[0]}
            results["backends"][backend] = {
                "first_push_s": pushes[0]["total_s"], "pushes": pushes, "mean": mean,
                "median_total_s": sorted(p["total_s"] for p in steady)[len(steady) // 2],
                "transfer_gbps": nbytes / mean["transfer"] / 1e9,
            }
    finally:
        stop.set()
        await asyncio.gather(*load, return_exceptions=True)
        await client.shutdown_async()

    def overlaps(start: float, end: float) -> bool:
        return any(start < w_end and end > w_start for w_start, w_end in windows)

    during = [end - start for start, end in latencies if overlaps(start, end)]
    outside = [end - start for start, end in latencies if not overlaps(start, end)]
    results["latency"] = {
        "during": {"n": len(during), "p50": pct(during, 50), "p99": pct(during, 99)} if during else None,
        "outside": {"n": len(outside), "p50": pct(outside, 50), "p99": pct(outside, 99)} if outside else None,
    }
    return results


def report(results: dict) -> None:
    memcpy = max(results["memcpy_gbps"].values())
    print(f"Full push of {results['bytes'] / 1e6:.0f} MB ({results['tensors']} tensors), fence included; "
          f"memcpy {memcpy:.2f} GB/s")
    print(f"{'backend':>8} {'first':>7} {'median':>7} | {'start':>6} {'transfer':>8} {'check':>6} {'commit':>7} | "
          f"{'GB/s':>5} {'x memcpy':>8}")
    for name, b in results["backends"].items():
        m = b["mean"]
        print(f"{name:>8} {b['first_push_s']:7.3f} {b['median_total_s']:7.3f} | {m['start']:6.3f} "
              f"{m['transfer']:8.3f} {m.get('check', 0.0):6.3f} {m['commit']:7.3f} | {b['transfer_gbps']:5.2f} "
              f"{b['transfer_gbps'] / memcpy:8.2f}")
    for when, lat in results["latency"].items():
        if lat:
            print(f"request latency {when} updates: n={lat['n']} p50 {lat['p50']:.3f} s, p99 {lat['p99']:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["shm", "zmq"], choices=["shm", "zmq"])
    parser.add_argument("--pushes", type=int, default=5, help="steady pushes per backend (after a first one)")
    parser.add_argument("--mode", default="wait", choices=["wait", "abort", "keep"])
    parser.add_argument("--load", type=int, default=4, help="concurrent background streams")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between pushes")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    results["machine"] = machine_info()
    report(results)
    print(f"wrote {write_json(RESULTS / 'bench_weight_update.json', results)}")


if __name__ == "__main__":
    main()
