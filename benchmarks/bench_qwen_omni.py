#!/usr/bin/env python
"""Qwen2.5-Omni served (thinker -> talker -> code2wav) against transformers' own ``generate``.

    python benchmarks/bench_qwen_omni.py [--concurrency 1,4,8] [--thinker-tokens 16] [--talker-codes 60]

``omni-engine serve`` of the tiny seeded checkpoint (``prepare-model qwen2.5-omni-tiny``), driven by
``omni-engine bench serve --backend openai-chat-audio`` (streamed chat with ``modalities: [text,
audio]``) at each concurrency, then transformers' ``Qwen2_5OmniForConditionalGeneration.generate(
return_audio=True)`` on the same prompts, one after another (as a script would run it), in this
process before the server starts (three warm-up runs first; the server: one round at each concurrency
before it is measured). Both do the same work per request: the thinker writes exactly
``--thinker-tokens`` tokens and the talker exactly ``--talker-codes`` codes (min = max tokens,
greedy), so code2wav renders the same length of speech. Figures: requests/s, TTFT, time to first
audio (TTFA; transformers: its whole time, as it returns the waveform at the end), RTF. The
issue's targets, as ratios of this one run: served requests/s at concurrency 8 >= 3x transformers',
first audio at 1 <= 0.5x transformers' end-to-end time, first audio p95 at 4 <= 2x its value at 1.
Writes ``benchmarks/results/bench_qwen_omni.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import RESULTS, machine_info, progress, stop_process_groups, write_json  # noqa: E402
from benchmarks.bench_startup import free_port, wait_healthy  # noqa: E402

SERVED = "qwen-omni-tiny"
QUESTIONS = ["What is the capital of France?", "Tell me about the sea.", "How do birds fly?",
             "Why is the sky blue?", "What is a lighthouse?", "Name a fruit.", "Sing me a song.",
             "What time is it?"]
SAMPLE_RATE = 24000
SAMPLES_PER_CODE = 2 * 240  # two mel frames a code, 240 samples a frame


def start_server(model_dir: Path, port: int, log: Path, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "omni_engine.entrypoints.cli.main", "serve", str(model_dir),
                                 "--port", str(port), "--served-model-name", SERVED, *extra],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def bench(base_url: str, concurrency: int, prompts: int, dataset: Path, thinker_tokens: int,
          talker_codes: int) -> dict[str, Any]:
    from omni_engine.bench.serve_bench import add_arguments, run_benchmark

    talker = {"temperature": 0.0, "max_tokens": talker_codes, "min_tokens": talker_codes}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--base-url", base_url, "--backend", "openai-chat-audio", "--model", SERVED, "--dataset-name", "custom",
        "--dataset-path", str(dataset), "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--random-output-len", str(thinker_tokens), "--ignore-eos", "--metric-percentiles", "50,95",
        "--extra-body", json.dumps({"min_tokens": thinker_tokens, "sampling_params_list": [None, talker]}),
        "--disable-tqdm"])
    return asyncio.run(run_benchmark(args))


def transformers_runs(model_dir: Path, prompts: list[str], thinker_tokens: int, talker_codes: int,
                      warmups: int = 3) -> list[float]:
    """Seconds of ``generate(return_audio=True)`` per prompt, one after another (after ``warmups``)."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omni_engine.models.qwen2_5_omni.processor import load_processor

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    processor = load_processor(model_dir)
    times = []
    for i, question in enumerate([*prompts[:warmups], *prompts]):
        text = processor.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        inputs = processor(text=text, return_tensors="pt")
        start = time.perf_counter()
        with torch.no_grad():
            _, wav = model.generate(**inputs, speaker="Chelsie", return_audio=True, thinker_do_sample=False,
                                    thinker_max_new_tokens=thinker_tokens, thinker_min_new_tokens=thinker_tokens,
                                    talker_do_sample=False, talker_max_new_tokens=talker_codes,
                                    talker_min_new_tokens=talker_codes)
        if i >= warmups:
            times.append(time.perf_counter() - start)
        progress(f"transformers {i}: {time.perf_counter() - start:.2f} s, {wav.numel() / SAMPLE_RATE:.2f} s of audio")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--prompts-per-level", type=int, default=16, help="requests at each concurrency")
    parser.add_argument("--thinker-tokens", type=int, default=16)
    parser.add_argument("--talker-codes", type=int, default=60)
    parser.add_argument("--json", default=str(RESULTS / "bench_qwen_omni.json"))
    args = parser.parse_args()
    from omni_engine.models.prepare import prepare_model

    model_dir = prepare_model("qwen2.5-omni-tiny")
    levels = [int(n) for n in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_qwen_omni_"))
    dataset = work / "questions.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS))
    # transformers first: after the server, its exiting processes still share the two cores
    times = transformers_runs(model_dir, QUESTIONS, args.thinker_tokens, args.talker_codes)
    log = RESULTS / "bench_qwen_omni_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = start_server(model_dir, port, log)
    served: dict[int, dict[str, Any]] = {}
    try:
        wait_healthy(proc, port, log)
        url = f"http://127.0.0.1:{port}"
        for n in levels:
            # Warm-up: one round at this concurrency (a batch size the stages have not run yet pays
            # one-time costs; measured here: the first 4 at once ~50 ms slower than the rounds after).
            bench(url, n, n, dataset, args.thinker_tokens, args.talker_codes)
            result = bench(url, n, max(args.prompts_per_level, n), dataset, args.thinker_tokens, args.talker_codes)
            served[n] = {k: result.get(k) for k in ("completed", "failed", "request_throughput", "median_ttft_ms",
                                                      "median_ttfa_ms", "p95_ttfa_ms", "median_rtf", "median_e2el_ms",
                                                      "errors")}
            progress(f"served, concurrency {n}: {served[n]}")
    finally:
        stop_process_groups([proc])
    audio_s = args.talker_codes * SAMPLES_PER_CODE / SAMPLE_RATE
    reference = {"requests": len(times), "request_throughput": len(times) / sum(times),
                 "median_e2el_ms": 1000 * statistics.median(times), "median_rtf": statistics.median(times) / audio_s}
    first = served[levels[0]]
    ratios = {
        "served_rps_at_8_over_transformers": (served[8]["request_throughput"] / reference["request_throughput"]
                                              if 8 in served else None),
        "first_audio_at_1_over_transformers_e2e": (first["median_ttfa_ms"] / reference["median_e2el_ms"]
                                                   if levels[0] == 1 else None),
        "p95_first_audio_at_4_over_at_1": (served[4]["p95_ttfa_ms"] / first["p95_ttfa_ms"]
                                           if 4 in served and levels[0] == 1 else None),
    }
    targets = {"served_rps_at_8_over_transformers": (">=", 3.0), "first_audio_at_1_over_transformers_e2e": ("<=", 0.5),
               "p95_first_audio_at_4_over_at_1": ("<=", 2.0)}
    print(f"\n{'':>28} | {'req/s':>6} | {'TTFT p50':>9} | {'TTFA p50':>9} | {'TTFA p95':>9} | {'RTF p50':>7}")
    for n, r in served.items():
        print(f"{'served, concurrency ' + str(n):>28} | {r['request_throughput']:6.2f} | {r['median_ttft_ms']:7.0f} ms"
              f" | {r['median_ttfa_ms']:7.0f} ms | {r['p95_ttfa_ms']:7.0f} ms | {r['median_rtf']:7.2f}")
    print(f"{'transformers, sequential':>28} | {reference['request_throughput']:6.2f} | {'':>9} | "
          f"{reference['median_e2el_ms']:7.0f} ms | {'':>9} | {reference['median_rtf']:7.2f}")
    for name, value in ratios.items():
        op, bound = targets[name]
        met = value is not None and (value >= bound if op == ">=" else value <= bound)
        print(f"{name}: {value if value is None else round(value, 2)} (target {op} {bound}: {'met' if met else 'NOT met'})")
    write_json(args.json, {"machine": machine_info(), "thinker_tokens": args.thinker_tokens,
                           "talker_codes": args.talker_codes, "audio_s_per_request": audio_s, "served": served,
                           "transformers": reference, "ratios": ratios})


if __name__ == "__main__":
    main()
