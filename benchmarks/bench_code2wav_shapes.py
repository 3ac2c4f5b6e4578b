#!/usr/bin/env python
"""Qwen3-Omni's code2wav on waves of streams: what oneDNN's first pass of each new shape costs, and
what padding pieces to a few lengths, warmed at start, saves.

    python benchmarks/bench_code2wav_shapes.py [--streams 8] [--waves 3] [--json out.json]

oneDNN builds a convolution's kernels on the first pass of each input shape (batch size included)
and caches them: a first pass costs ~2x a later one. A wave of ``--streams`` streams, each cut by the
default codec plan (4, 4, 8, 16, 25, 25 frames and a last piece whose length differs from wave to
wave, as answers' lengths do), is rendered as the stage's batcher hands it (each piece index of every
stream at once). Three ways, each in a process of its own (the kernel cache is per process):

- ``exact``: before this change: every piece at its own length, a group of alike pieces in one pass;
- ``padded``: pieces padded to a multiple of ``LENGTH_STEP`` frames, passes of 1, 2, 4 or 8 pieces
  of at most ``pass_frames`` frames, not warmed;
- ``warmed``: as ``padded``, its shapes made at start (``Code2Wav.warm_up``).

Per way: the start, each wave's render time; the first wave over the last (the first-pass cost a
server's first wave pays) and each way's first wave over ``exact``'s. The tiny checkpoint, one
thread (the stage's). Writes ``benchmarks/results/bench_code2wav_shapes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("exact", "padded", "warmed")


def run_way(way: str, streams: int, waves: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch

    from omni_engine.models.prepare import prepare_model
    from omni_engine.models.qwen3_omni_moe import code2wav as module
    from omni_engine.models.qwen3_omni_moe.code2wav_chunks import CodecStream

    model_dir = str(prepare_model("qwen3-omni-tiny"))
    if way == "exact":
        module.LENGTH_STEP = 1  # (the code before: no padding, every alike group in one pass)
    start = time.perf_counter()
    model = module.Code2Wav(model=model_dir, warm_up=way == "warmed",
                            pass_frames=1 << 20 if way == "exact" else 48)
    started = time.perf_counter() - start
    rng = np.random.default_rng(0)
    times = []
    for wave in range(waves):
        pieces = [CodecStream().finish(rng.integers(0, model.codebook, (model.groups, 83 + wave)))
                  for _ in range(streams)]
        t0 = time.perf_counter()
        for index in range(len(pieces[0])):
            model.render([(torch.as_tensor(p[index]["codes"]), p[index]["left_context"]) for p in pieces])
        times.append((time.perf_counter() - t0) * 1000)
    return {"start_s": round(started, 2), "wave_ms": [round(t, 1) for t in times]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "bench_code2wav_shapes.json")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # (one way, in its own process)
    args = parser.parse_args()
    if args.way:
        print(json.dumps(run_way(args.way, args.streams, args.waves)))
        return
    results = {}
    for way in WAYS:
        out = subprocess.run([sys.executable, __file__, "--way", way, "--streams", str(args.streams),
                              "--waves", str(args.waves)], capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        results[way] = json.loads(out.stdout.strip().splitlines()[-1])
    exact_first = results["exact"]["wave_ms"][0]
    print(f"{args.streams} streams a wave, the default codec plan; render ms per wave")
    for way, r in results.items():
        waves = r["wave_ms"]
        r["first_over_last"] = round(waves[0] / waves[-1], 2)
        r["first_over_exact_first"] = round(waves[0] / exact_first, 2)
        print(f"  {way:7s} start {r['start_s']:5.2f} s  waves {waves}  first/last {r['first_over_last']:.2f}  "
              f"first/exact's first {r['first_over_exact_first']:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"streams": args.streams, "waves": args.waves, "results": results}, indent=2))


if __name__ == "__main__":
    main()
