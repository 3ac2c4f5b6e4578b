#!/usr/bin/env python
"""Speech under load: ``/v1/audio/speech`` streamed as raw PCM (as OpenAI's clients play it), N
streams at once, against this code and the code before, side by side.

    python benchmarks/bench_speech_load.py [--before d10a727] [--streams 1,4,8,12,16] [--rounds 2]
        [--config stage_configs/smollm2_piper.yaml]

``--before`` is a git revision: it is checked out into a temporary worktree and served from there
(``python -m omni_engine...`` with that tree first on the path), so both servers run on the same
machine at the same time; each load level runs against one then the other (alternating who goes
first by round). Every stream asks for the same 4-sentence passage (~13 s of speech) with
``omni-engine bench serve --backend openai-speech --speech-format pcm``: its listener plays at 1x
from the first chunk, so the figures are first audio (p50, p95) and underruns (streams that heard
a gap, and the silence). Writes ``benchmarks/results/bench_speech_load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import REPO, RESULTS, machine_info, progress, stop_process_groups, write_json  # noqa: E402
from benchmarks.bench_startup import free_port, wait_healthy  # noqa: E402

PASSAGE = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in the salt wind. "
           "Every evening the keeper climbed the narrow stairs to light the great lamp. "
           "Ships passing in the night would see its beam sweep across the dark water. "
           "Nobody in the village could remember a night when the light had failed.")
FIGURES = ("median_ttfa_ms", "p95_ttfa_ms", "streams_with_underruns", "underrun_ms", "audio_throughput",
           "completed", "failed")


def start_server(tree: Path, config: str, port: int, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "omni_engine.entrypoints.cli.main", "serve", str(REPO / config), "--port",
             str(port), "--served-model-name", "smollm2"],
            cwd=tree, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(tree)})


def bench(base_url: str, streams: int, dataset: Path) -> dict[str, Any]:
    from omni_engine.bench.serve_bench import add_arguments, run_benchmark

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--base-url", base_url, "--backend", "openai-speech", "--speech-format", "pcm", "--model", "smollm2",
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--num-prompts", str(streams),
        "--max-concurrency", str(streams), "--metric-percentiles", "50,95", "--disable-tqdm"])
    return asyncio.run(run_benchmark(args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="d10a727", help="git revision of the code before")
    parser.add_argument("--config", default="stage_configs/smollm2_piper.yaml")
    parser.add_argument("--streams", default="1,4,8,12,16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=str(RESULTS / "bench_speech_load.json"))
    args = parser.parse_args()
    levels = [int(n) for n in args.streams.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_speech_load_"))
    before = work / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=REPO, check=True,
                   capture_output=True)
    dataset = work / "passage.jsonl"
    dataset.write_text(json.dumps({"prompt": PASSAGE}) + "\n")
    log_dir = RESULTS / "bench_speech_load_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    trees = {"before": before, "after": REPO}
    ports = {name: free_port() for name in trees}
    procs = {name: start_server(tree, args.config, ports[name], log_dir / f"{name}.log")
             for name, tree in trees.items()}
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {name: {n: [] for n in levels} for name in trees}
    try:
        for name, proc in procs.items():
            wait_healthy(proc, ports[name], log_dir / f"{name}.log")
        progress("both servers healthy")
        for name in trees:  # warm-up: the first answers of a fresh server are slower
            bench(f"http://127.0.0.1:{ports[name]}", 2, dataset)
        for r in range(args.rounds):
            for n in levels:
                for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    result = bench(f"http://127.0.0.1:{ports[name]}", n, dataset)
                    runs[name][n].append({k: result.get(k) for k in FIGURES})
                    progress(f"round {r + 1} {name:6s} {n:2d} streams: first audio p50 "
                             f"{result['median_ttfa_ms']:.0f} ms p95 {result['p95_ttfa_ms']:.0f} ms, "
                             f"{result['streams_with_underruns']} streams with underruns "
                             f"({result['underrun_ms']:.0f} ms), failed {result['failed']}")
    finally:
        stop_process_groups(procs.values())
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=REPO, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    medians = {name: {n: {k: statistics.median(x[k] for x in v) for k in FIGURES} for n, v in by_n.items()}
               for name, by_n in runs.items()}
    print(f"\n{'streams':>7} | {'first audio p50 / p95 before':>30} | {'after':>18} | underrun streams before / after")
    for n in levels:
        b, a = medians["before"][n], medians["after"][n]
        print(f"{n:>7} | {b['median_ttfa_ms']:>13.0f} / {b['p95_ttfa_ms']:<6.0f} ms      | "
              f"{a['median_ttfa_ms']:>6.0f} / {a['p95_ttfa_ms']:<6.0f} ms | "
              f"{b['streams_with_underruns']:g} / {a['streams_with_underruns']:g}")
    write_json(args.json, {"machine": machine_info(), "config": args.config, "before": args.before,
                           "passage": PASSAGE, "rounds": runs, "medians": medians})


if __name__ == "__main__":
    main()
