#!/usr/bin/env python
"""The SmolLM2 pipelines under load: new vs legacy architecture, and our layer vs plain vLLM.

    python benchmarks/bench_pipeline.py [--quick] [--concurrency 1 8 32]

1. Speech pipeline (stage_configs/smollm2_speech.yaml: SmolLM2 -> eSpeak NG),
   new and legacy architecture both running, in ``sequential`` and
   ``async_chunk`` mode, at each concurrency: time to first text, time to
   first audio (medians over requests), tokens/s and requests/s. The two
   architectures take turns on the same prompts, so noise hits both alike.
2. Text pipeline (stage_configs/smollm2_text.yaml, one vLLM stage) through
   ``MultiStageEngineClient`` against plain vLLM ``AsyncLLM`` built in this
   process from the same engine arguments, on the same prompts, each request
   generating exactly ``--max-tokens`` tokens: the cost of our layer.

Writes JSON and a PNG to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
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

PLAIN = "vLLM AsyncLLM"
INPROC = "AsyncLLM in-process"
QUESTIONS = [
    "What is the capital of France?", "Tell me a short story about a cat.", "Why is the sky blue?",
    "Name three fruits.", "How do bees make honey?", "What is two plus two?",
    "Describe the sea in two sentences.", "Give me a tip for sleeping well.",
]


def chat_prompts(model_dir: str, n: int) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                    tokenize=False, add_generation_prompt=True) for i in range(n)]


def sampling(max_tokens: int, ignore_eos: bool) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                          output_kind=RequestOutputKind.DELTA)


async def run_load(stream_fn: Any, prompts: list[str], concurrency: int) -> dict[str, Any]:
    """Run every prompt, ``concurrency`` at a time; per-request first text/audio, tokens."""
    sem = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()
    records: list[dict[str, float]] = []

    async def one(i: int, prompt: str) -> None:
        async with sem:
            t0 = loop.time()
            rec = {"tokens": 0, "first_text": None, "first_audio": None}
            async for out in stream_fn(prompt, f"r{i}-{time.monotonic_ns()}"):
                now = loop.time() - t0
                if getattr(out, "final_output_type", "text") == "audio":
                    if out.multimodal_output and rec["first_audio"] is None:
                        rec["first_audio"] = now
                elif out.outputs:
                    rec["tokens"] += len(out.outputs[0].token_ids)
                    if rec["first_text"] is None and out.outputs[0].token_ids:
                        rec["first_text"] = now
            rec["e2e"] = loop.time() - t0
            records.append(rec)

    t0 = loop.time()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = loop.time() - t0

    def median(key: str) -> float | None:
        vals = [r[key] for r in records if r[key] is not None]
        return statistics.median(vals) if vals else None

    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "requests_per_s": len(records) / wall, "first_text_s": median("first_text"),
            "first_audio_s": median("first_audio"), "e2e_s": median("e2e")}


def best_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each metric at its best over the rounds: the least disturbed measurement of it."""
    best = dict(results[0])
    for key in ("tokens_per_s", "requests_per_s"):
        best[key] = max(r[key] for r in results)
    for key in ("first_text_s", "first_audio_s", "e2e_s", "wall_s"):
        vals = [r[key] for r in results if r[key] is not None]
        best[key] = min(vals) if vals else None
    best["rounds"] = len(results)
    return best


async def alternate(streams: dict[str, Any], prompts: list[str], concurrency: int,
                    rounds: int) -> dict[str, dict[str, Any]]:
    """Each engine in turn, ``rounds`` times, on the same prompts; the best of each."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in streams}
    for name, stream in streams.items():
        await run_load(stream, prompts[:2], 2)  # warm-up
    for _ in range(rounds):
        for name, stream in streams.items():
            runs[name].append(await run_load(stream, prompts, concurrency))
    return {name: best_of(results) for name, results in runs.items()}


def n_requests(concurrency: int, quick: bool) -> int:
    return max(concurrency, 2 if quick else 4) * (1 if quick else 2) if concurrency < 32 else concurrency


async def speech_part(args: argparse.Namespace, model_dir: str) -> list[dict[str, Any]]:
    from omni_engine.config import load_pipeline_config
    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
    from omni_engine.legacy import start_legacy_pipeline

    config = load_pipeline_config("stage_configs/smollm2_speech.yaml")
    progress("speech pipeline: starting new and legacy ...")
    engines = dict(zip(("new", "legacy"), await asyncio.gather(
        MultiStageEngineClient.from_config(config), start_legacy_pipeline(config))))
    rows = []
    try:
        params = [sampling(args.max_tokens, ignore_eos=False), None]
        for conc in args.concurrency:
            prompts = chat_prompts(model_dir, n_requests(conc, args.quick))
            for mode in ("sequential", "async_chunk"):
                streams = {arch: (lambda p, rid, e=engine, m=mode: e.generate(p, params, rid, execution_mode=m))
                           for arch, engine in engines.items()}
                for arch, result in (await alternate(streams, prompts, conc, args.rounds)).items():
                    row = {"part": "speech", "arch": arch, "mode": mode, "concurrency": conc, **result}
                    rows.append(row)
                    progress(f"  {arch:>6} {mode:>11} c={conc:<3} first text {row['first_text_s']:.3f} s, "
                             f"first audio {row['first_audio_s']:.3f} s, {row['tokens_per_s']:.0f} tok/s")
    finally:
        await asyncio.gather(*(e.shutdown_async() for e in engines.values()))
    return rows


async def text_part(args: argparse.Namespace, model_dir: str) -> list[dict[str, Any]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from omni_engine.config import load_pipeline_config
    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient

    from omni_engine.pipeline.stage_specs import prepare_models

    config = prepare_models(load_pipeline_config("stage_configs/smollm2_text.yaml"))
    engine_args = config.stage(0).engine_args_for_engine()
    progress("text pipeline: starting MultiStageEngineClient and plain AsyncLLM (vLLM's default: engine core "
             "in its own process; and with the core in-process, as our stage runs it) ...")
    ours = await MultiStageEngineClient.from_config(config)
    plain = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        inproc = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    finally:
        del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
    params = sampling(args.max_tokens, ignore_eos=True)
    streams = {"omni_engine": lambda p, rid: ours.generate(p, params, rid),
               PLAIN: lambda p, rid: plain.generate(p, params, rid),
               INPROC: lambda p, rid: inproc.generate(p, params, rid)}
    rows = []
    try:
        for conc in args.concurrency:
            prompts = chat_prompts(model_dir, n_requests(conc, args.quick))
            results = await alternate(streams, prompts, conc, args.rounds)
            for name, result in results.items():
                rows.append({"part": "text", "arch": name, "mode": "-", "concurrency": conc, **result})
            best_plain = max(results[PLAIN]["tokens_per_s"], results[INPROC]["tokens_per_s"])
            progress(f"  c={conc:<3} omni_engine {results['omni_engine']['tokens_per_s']:.0f} tok/s, AsyncLLM "
                     f"{results[PLAIN]['tokens_per_s']:.0f} / in-process {results[INPROC]['tokens_per_s']:.0f} "
                     f"tok/s: {100 * results['omni_engine']['tokens_per_s'] / best_plain:.1f} % of the faster")
    finally:
        await ours.shutdown_async()
        plain.shutdown()
        inproc.shutdown()
    return rows


def print_tables(rows: list[dict[str, Any]]) -> None:
    def f(v: float | None, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    print("\n1. Speech pipeline, new vs legacy (medians over requests; tok/s and req/s over the run)")
    print(f"{'mode':<12}{'conc':>5} {'arch':<7}{'first text':>11}{'first audio':>12}{'e2e':>8}"
          f"{'tok/s':>8}{'req/s':>7}   new/legacy tok/s")
    speech = [r for r in rows if r["part"] == "speech"]
    for r in speech:
        other = next((o for o in speech if o["mode"] == r["mode"] and o["concurrency"] == r["concurrency"]
                      and o["arch"] == "legacy"), None)
        ratio = f"{r['tokens_per_s'] / other['tokens_per_s']:.3f}" if r["arch"] == "new" and other else ""
        print(f"{r['mode']:<12}{r['concurrency']:>5} {r['arch']:<7}{f(r['first_text_s']):>11}"
              f"{f(r['first_audio_s']):>12}{f(r['e2e_s']):>8}{r['tokens_per_s']:>8.1f}{r['requests_per_s']:>7.2f}"
              f"   {ratio}")
    print("\n2. One vLLM stage: omni_engine vs plain vLLM AsyncLLM (same engine args, prompts, tokens)")
    print(f"{'conc':>5} {'engine':<20}{'first text':>11}{'tok/s':>9}{'req/s':>7}{'x faster AsyncLLM':>19}")
    text = [r for r in rows if r["part"] == "text"]
    for r in text:
        plain = max(o["tokens_per_s"] for o in text
                    if o["concurrency"] == r["concurrency"] and o["arch"] != "omni_engine")
        print(f"{r['concurrency']:>5} {r['arch']:<20}{f(r['first_text_s']):>11}{r['tokens_per_s']:>9.1f}"
              f"{r['requests_per_s']:>7.2f}{r['tokens_per_s'] / plain:>19.3f}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, (ax_audio, ax_tok, ax_text) = new_figure(3, width=5)
    for arch, style in (("new", "-"), ("legacy", "--")):
        for mode, color in (("sequential", "tab:blue"), ("async_chunk", "tab:orange")):
            sel = [r for r in rows if r["part"] == "speech" and r["arch"] == arch and r["mode"] == mode]
            conc = [r["concurrency"] for r in sel]
            ax_audio.plot(conc, [r["first_audio_s"] for r in sel], style, color=color, marker="o",
                          label=f"{arch} {mode}")
            ax_tok.plot(conc, [r["tokens_per_s"] for r in sel], style, color=color, marker="o",
                        label=f"{arch} {mode}")
    ax_audio.set(xscale="log", xlabel="concurrency", ylabel="s", title="speech: time to first audio")
    ax_tok.set(xscale="log", xlabel="concurrency", ylabel="tokens/s", title="speech: tokens/s")
    ax_audio.legend(fontsize=7)
    for arch in ("omni_engine", PLAIN, INPROC):
        sel = [r for r in rows if r["part"] == "text" and r["arch"] == arch]
        ax_text.plot([r["concurrency"] for r in sel], [r["tokens_per_s"] for r in sel], marker="o", label=arch)
    ax_text.set(xscale="log", xlabel="concurrency", ylabel="tokens/s", title="one vLLM stage vs AsyncLLM")
    ax_text.legend(fontsize=7)
    save_figure(fig, path)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from omni_engine.config import load_pipeline_config
    from omni_engine.pipeline.stage_specs import prepare_models

    model_dir = prepare_models(load_pipeline_config("stage_configs/smollm2_text.yaml")).stage(0).engine_args["model"]
    rows = []
    if not args.text_only:
        rows += await speech_part(args, model_dir)
    if not args.speech_only:
        rows += await text_part(args, model_dir)
    return {"benchmark": "bench_pipeline", "machine": machine_info(), "args": vars(args), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests per run")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="runs per engine and setting (each metric's best is kept)")
    ap.add_argument("--speech-only", action="store_true")
    ap.add_argument("--text-only", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "bench_pipeline"), help="path prefix for .json and .png")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import logging

    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    res = asyncio.run(main_async(args))
    res["total_seconds"] = round(time.perf_counter() - t0, 1)
    print_tables(res["rows"])
    write_json(f"{args.out}.json", res)
    if not (args.speech_only or args.text_only):
        plot(res["rows"], Path(f"{args.out}.png"))


if __name__ == "__main__":
    main()
