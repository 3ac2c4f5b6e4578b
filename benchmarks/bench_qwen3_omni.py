#!/usr/bin/env python
"""Qwen3-Omni-MoE served (thinker -> talker -> code2wav): async_chunk against sequential.

    python benchmarks/bench_qwen3_omni.py [--concurrency 1,4] [--thinker-tokens 16] [--talker-frames 60]

Two ``omni-engine serve`` runs of the tiny seeded checkpoint (``prepare-model qwen3-omni-tiny``),
one after the other in this one run: the family's config (``async_chunk``: code2wav decodes the
first 4 frames as soon as the talker has made them, then 25 at a time) and
``stage_configs/qwen3_omni_moe_sequential.yaml`` (code2wav decodes all the frames at the end),
driven by ``omni-engine bench serve --backend openai-chat-audio`` (streamed chat with ``modalities:
[text, audio]``). Each request does the same work: exactly ``--thinker-tokens`` thinker tokens and
``--talker-frames`` talker frames (min = max tokens, greedy). The issue's targets, as ratios of this
run: first audio at concurrency 1 with async_chunk <= 0.4x the sequential config's; first audio p95
at concurrency 4 <= 1.5x its p50 at 1. (Under async_chunk the talker starts on the thinker's first states,
and code2wav on the talker's first frames.) Writes ``benchmarks/results/bench_qwen3_omni.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import RESULTS, machine_info, progress, stop_process_groups, write_json  # noqa: E402
from benchmarks.bench_qwen_omni import QUESTIONS, bench, start_server  # noqa: E402
from benchmarks.bench_startup import free_port, wait_healthy  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KEYS = ("completed", "failed", "request_throughput", "median_ttft_ms", "median_ttfa_ms", "p95_ttfa_ms",
        "median_rtf", "median_e2el_ms", "errors")


def serve_and_bench(target: str, name: str, levels: list[int], prompts: int, dataset: Path, thinker_tokens: int,
                    talker_tokens: int) -> dict[int, dict[str, Any]]:
    log = RESULTS / f"bench_qwen3_omni_{name}_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = start_server(Path(target), port, log)
    served: dict[int, dict[str, Any]] = {}
    try:
        wait_healthy(proc, port, log)
        url = f"http://127.0.0.1:{port}"
        bench(url, 2, 2, dataset, thinker_tokens, talker_tokens)  # warm-up
        for n in levels:
            result = bench(url, n, max(prompts, n), dataset, thinker_tokens, talker_tokens)
            served[n] = {k: result.get(k) for k in KEYS}
            progress(f"{name}, concurrency {n}: {served[n]}")
    finally:
        stop_process_groups([proc])
    return served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--prompts-per-level", type=int, default=8, help="requests at each concurrency")
    parser.add_argument("--thinker-tokens", type=int, default=16)
    parser.add_argument("--talker-frames", type=int, default=60)
    parser.add_argument("--json", default=str(RESULTS / "bench_qwen3_omni.json"))
    args = parser.parse_args()
    from omni_engine.models.prepare import prepare_model

    model_dir = prepare_model("qwen3-omni-tiny")
    levels = [int(n) for n in args.concurrency.split(",")]
    dataset = Path(tempfile.mkdtemp(prefix="bench_qwen3_omni_")) / "questions.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS))
    talker_tokens = args.talker_frames + 1  # a frame is completed at the step after its first code
    runs = {name: serve_and_bench(target, name, levels, args.prompts_per_level, dataset, args.thinker_tokens,
                                  talker_tokens)
            for name, target in (("async_chunk", str(model_dir)),
                                 ("sequential", str(REPO / "stage_configs" / "qwen3_omni_moe_sequential.yaml")))}
    chunked, whole = runs["async_chunk"], runs["sequential"]
    ratios = {
        "first_audio_at_1_async_over_sequential": (chunked[1]["median_ttfa_ms"] / whole[1]["median_ttfa_ms"]
                                                   if 1 in chunked else None),
        "p95_first_audio_at_4_over_p50_at_1": (chunked[4]["p95_ttfa_ms"] / chunked[1]["median_ttfa_ms"]
                                               if 4 in chunked and 1 in chunked else None),
    }
    targets = {"first_audio_at_1_async_over_sequential": 0.4, "p95_first_audio_at_4_over_p50_at_1": 1.5}
    print(f"\n{'':>28} | {'req/s':>6} | {'TTFT p50':>9} | {'TTFA p50':>9} | {'TTFA p95':>9} | {'RTF p50':>7}")
    for name, served in runs.items():
        for n, r in served.items():
            print(f"{name + ', concurrency ' + str(n):>28} | {r['request_throughput']:6.2f} | "
                  f"{r['median_ttft_ms']:7.0f} ms | {r['median_ttfa_ms']:7.0f} ms | {r['p95_ttfa_ms']:7.0f} ms | "
                  f"{r['median_rtf']:7.2f}")
    for name, value in ratios.items():
        met = value is not None and value <= targets[name]
        print(f"{name}: {value if value is None else round(value, 2)} (target <= {targets[name]}: "
              f"{'met' if met else 'NOT met'})")
    write_json(args.json, {"machine": machine_info(), "thinker_tokens": args.thinker_tokens,
                           "talker_frames": args.talker_frames, "audio_s_per_request": args.talker_frames * 0.08,
                           "runs": runs, "ratios": ratios})


if __name__ == "__main__":
    main()
