"""Full pushes of SmolLM2-135M (float32, ~540 MB) into a running one-stage pipeline, fence included.

    python benchmarks/bench_weight_update.py [--pushes 5] [--backends shm zmq] [--mode wait]

Per backend, on an idle pipeline: the fenced push (pause, transfer, check on every replica,
commit, prefix-cache reset, resume) end to end, and its phases; the transfer's GB/s against an
in-process memcpy in the same run. The first push of a backend pays first-touch page faults
(staging buffers, store files): reported apart, left out of the steady figures. Then under a
background load (``--load`` streams): request latency p50/p99 of requests that overlapped an
update and of those that did not, and the pushes' times (``--mode`` decides whether a push
waits for the requests in flight).
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
        "final_output_type": "text"}], "weights": {"backend": args.backends[0].removesuffix("-plain")}})
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
    try:
        # 1. Idle: the push itself, fence included (nothing in flight to wait for).
        for backend in args.backends:
            # zmq-plain: the zmq backend without CURVE (what the encryption costs).
            with WeightSender(backend.removesuffix("-plain"), curve=not backend.endswith("-plain")) as sender:
                await client.init_weight_transfer_engine(sender.init_info())
                pushes = []
                for i in range(args.pushes + 1):
                    version += 1
                    t0 = time.perf_counter()
                    await sender.push_async(client, state, str(version), mode=args.mode)
                    pushes.append({"total_s": time.perf_counter() - t0, **client.weights.timings})
                    progress(f"{backend} push {i}: {pushes[-1]}")
            steady = pushes[1:]
            mean = {k: sum(p[k] for p in steady) / len(steady) for k in steady[0]}
            results["backends"][backend] = {
                "first_push_s": pushes[0]["total_s"], "pushes": pushes, "mean": mean,
                "median_total_s": sorted(p["total_s"] for p in steady)[len(steady) // 2],
                "transfer_gbps": nbytes / mean["transfer"] / 1e9,
            }
        # 2. Under load: request latency outside updates, then while shm pushes come every --gap s.
        load = [asyncio.create_task(stream(k)) for k in range(args.load)]
        await asyncio.sleep(args.quiet)
        with WeightSender("shm") as sender:
            await client.init_weight_transfer_engine(sender.init_info())
            for _ in range(args.pushes):
                version += 1
                t0 = time.perf_counter()
                await sender.push_async(client, state, str(version), mode=args.mode)
                windows.append((t0, time.perf_counter()))
                await asyncio.sleep(args.gap)
        stop.set()
        await asyncio.gather(*load, return_exceptions=True)
        results["load_pushes_s"] = [end - start for start, end in windows]
    finally:
        stop.set()
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
    pushes = sorted(results["load_pushes_s"])
    print(f"shm pushes under load ({args_mode(results)}): median {pushes[len(pushes) // 2]:.3f} s, "
          f"max {pushes[-1]:.3f} s")
    for when, lat in results["latency"].items():
        if lat:
            print(f"request latency {when} updates: n={lat['n']} p50 {lat['p50']:.3f} s, p99 {lat['p99']:.3f} s")


def args_mode(results: dict) -> str:
    return f"mode {results['mode']}, {results['load']} streams"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["shm", "zmq", "zmq-plain"],
                        choices=["shm", "zmq", "zmq-plain"])
    parser.add_argument("--pushes", type=int, default=5, help="steady pushes per backend (after a first one)")
    parser.add_argument("--mode", default="wait", choices=["wait", "abort", "keep"])
    parser.add_argument("--load", type=int, default=4, help="concurrent background streams")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--gap", type=float, default=3.0, help="seconds between pushes under load")
    parser.add_argument("--quiet", type=float, default=15.0, help="seconds of load before the first push")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    results.update(machine=machine_info(), mode=args.mode, load=args.load)
    report(results)
    write_json(RESULTS / "bench_weight_update.json", results)


if __name__ == "__main__":
    main()
