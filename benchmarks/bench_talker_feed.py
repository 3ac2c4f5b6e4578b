#!/usr/bin/env python
"""The cost of feeding a talker the thinker's reply in parts (async_chunk), per part, as the answer grows.

    python benchmarks/bench_talker_feed.py [--reply-rows 300] [--prompt-rows 200] [--json out.json]

A talker that starts on the thinker's first states gets one part per thinker token: the stage
hands the rows to the worker's model through ``/dev/shm`` files, and the model turns them into its
input rows (Qwen3-Omni: a projection to the talker's width). Two ways, in one run, at the published
checkpoints' thinker widths (Qwen2.5-Omni-7B: 3584; Qwen3-Omni-30B-A3B: 2048, projected to 1024):

- ``append`` (ours, ``omni_engine.models.reply_parts``): the stage appends a part's rows to a row
  file; the model reads the new rows only and projects them once, into a buffer that grows in place;
- ``rewrite`` (what it replaced, re-enacted here): the stage rewrites the request's whole inputs
  file (prompt + every reply row so far) at each part; the model reads it whole and projects the
  prompt and the reply again.

Per width: the whole answer's feed time, and the last part's, for each way; their ratio. Writes
``benchmarks/results/bench_talker_feed.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import RESULTS, machine_info, write_json  # noqa: E402
from omni_engine.models.reply_parts import ReplyParts, ReplyRows  # noqa: E402

# (name, thinker width, the talker's width after the projection; None: no projection, as Qwen2.5's)
WIDTHS = (("qwen2.5-omni-7b", 3584, None), ("qwen3-omni-30b-a3b", 2048, 1024))


def project_with(width: int, out: int | None) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Identity() if out is None else torch.nn.Linear(width, out)


@torch.inference_mode()
def feed_append(folder: str, prompt: torch.Tensor, reply: torch.Tensor, project: torch.nn.Module) -> list[float]:
    """Seconds per part, ours: the inputs file once, then each part's rows appended and read."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "append")
    parts = ReplyParts()
    rows = {"user_rows": prompt, "reply_rows": reply[:1].clone()}
    parts.open("r", rows)
    save_file(rows, path)
    inputs = load_file(path)
    project(inputs["user_rows"])  # (the prompt: projected once, at the first part)
    model_rows = ReplyRows(inputs, path, project)
    times = []
    for k in range(1, reply.shape[0]):
        start = time.perf_counter()
        parts.append("r", reply[k:k + 1], last=k == reply.shape[0] - 1)
        parts.write("r", path)  # the stage, before the chunk that reads them
        model_rows.more()  # the model, at the frame that needs them
        times.append(time.perf_counter() - start)
    assert model_rows.count == reply.shape[0] and model_rows.whole
    return times


@torch.inference_mode()
def feed_rewrite(folder: str, prompt: torch.Tensor, reply: torch.Tensor, project: torch.nn.Module) -> list[float]:
    """Seconds per part, the way it replaced: the whole file rewritten, read and projected again."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "rewrite")
    known = reply[:1].clone()
    times = []
    for k in range(1, reply.shape[0]):
        start = time.perf_counter()
        known = torch.cat([known, reply[k:k + 1]])
        save_file({"user_rows": prompt, "reply_rows": known}, f"{path}.part")
        os.replace(f"{path}.part", path)
        inputs = load_file(path)
        project(inputs["user_rows"]), project(inputs["reply_rows"])
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reply-rows", type=int, default=300, help="thinker tokens in the answer (one part each)")
    parser.add_argument("--prompt-rows", type=int, default=200)
    parser.add_argument("--json", default=str(RESULTS / "bench_talker_feed.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # (a talker worker's share of these cores)
    results = {}
    print(f"{'':>20} | {'append: answer':>15} | {'last part':>9} | {'rewrite: answer':>15} | {'last part':>9} | ratio")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        for name, width, out in WIDTHS:
            generator = torch.Generator().manual_seed(0)
            prompt = torch.randn(args.prompt_rows, width, generator=generator)
            reply = torch.randn(args.reply_rows, width, generator=generator)
            project = project_with(width, out)
            os.makedirs(os.path.join(folder, name))
            append = feed_append(os.path.join(folder, name), prompt, reply, project)
            rewrite = feed_rewrite(os.path.join(folder, name), prompt, reply, project)
            row = {"append_answer_ms": sum(append) * 1e3, "append_last_part_ms": append[-1] * 1e3,
                   "rewrite_answer_ms": sum(rewrite) * 1e3, "rewrite_last_part_ms": rewrite[-1] * 1e3}
            row["rewrite_over_append"] = row["rewrite_answer_ms"] / row["append_answer_ms"]
            results[name] = row
            print(f"{name:>20} | {row['append_answer_ms']:12.1f} ms | {row['append_last_part_ms']:6.2f} ms | "
                  f"{row['rewrite_answer_ms']:12.1f} ms | {row['rewrite_last_part_ms']:6.2f} ms | "
                  f"{row['rewrite_over_append']:.1f}x")
    path = write_json(args.json, {"machine": machine_info(), "reply_rows": args.reply_rows,
                                  "prompt_rows": args.prompt_rows, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
