"""The async actor-learner loop against the synchronous one: same optimizer steps, same data.

    python benchmarks/bench_actor_learner.py [--steps 16] [--rounds 1] [--ranks 2] [--set FIELD=VALUE ...]

Both run ``examples/rl/actor_learner.py`` under torchrun (gloo, CPU) against one
``omni-engine serve`` of SmolLM2 started here: the synchronous loop
(``stage2_ab.async.enabled: false``: a step that wants B rolls out, then trains) and the
async one (background prefetch into versioned ready queues, fenced syncs). The server
gets the checkpoint back between runs, so each starts from the same weights.

By default the learner ranks and the server get disjoint halves of the cores, as the seed's
topology gives them disjoint GPUs (``--shared-cores``: everything competes for all cores, where
overlapping rollouts with training cannot gain much: both phases already keep every core busy).

Reported per mode: wall time (no GPU here), optimizer steps per second, the fraction of
the learner's time spent waiting (inline rollouts, fences, anything but forward/backward/
optimizer), the executed B ratio and skips, and the version lag of consumed packs.
Target: async >= 1.6x the synchronous loop's steps per second.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import REPO, RESULTS, machine_info, progress, write_json

EXAMPLE = REPO / "examples" / "rl" / "actor_learner.py"
PUSH = REPO / "examples" / "rl" / "push_weights.py"
PIPELINE = REPO / "stage_configs" / "smollm2_text.yaml"
# The benchmark's run: every step wants B, one micro-step per step, a push every 4 steps, and rollouts of
# 64 tokens (min_tokens: the model keeps naming words after its answer; the target stays the matched
# ground truth). The seed's rollouts are object lists from a model on 6 GPUs of 8: generation, not
# training, is the longer phase. The example's own answers (~10 tokens) make training the longer one
# here, which bounds any overlap at 1.37x: --set rollout.min_tokens=0 --set rollout.max_tokens=32.
BASE = {"train.gradient_accumulation_steps": 1, "sync.every_steps": 4, "packing.packing_length": 160,
        "packing.packing_min_fill_ratio": 0.5, "data.heldout": "null", "stage2_ab.async.rollout_batch_size": 4,
        "stage2_ab.async.queue_limit": 4, "stage2_ab.schedule.b_ratio": 1.0, "rollout.max_tokens": 64,
        "rollout.min_tokens": 64}


def run_example(url: str, asynchronous: bool, args: argparse.Namespace, log_dir: Path,
                cpus: set[int] | None) -> dict:
    settings = {**BASE, "train.steps": args.steps, "stage2_ab.async.enabled": str(asynchronous).lower()}
    settings.update(dict(pair.split("=", 1) for pair in args.set))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), str(EXAMPLE),
           "--url", url, "--log-dir", str(log_dir), "--set", "rollout.model=smollm2"]
    for key, value in settings.items():
        cmd += ["--set", f"{key}={value}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    if done.returncode != 0:
        raise SystemExit(f"the example failed ({'async' if asynchronous else 'sync'}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def restore(url: str, checkpoint: Path) -> None:
    """The server back on the checkpoint's weights, under the next version number."""
    import httpx

    label = httpx.get(f"{url}/weight_info", timeout=30).json()["weight_version"]
    version = int(label) + 1 if label.isdigit() else 1
    subprocess.run([sys.executable, str(PUSH), "--url", url, "--weights", str(checkpoint), "--version", str(version)],
                   check=True, capture_output=True)


def figures(summary: dict) -> dict:
    keys = ("wall_s", "steps_per_s", "learner_wait_fraction", "executed_b_ratio", "b_step_skipped_due_to_queue",
            "version_lag", "rollout_latency_s", "stale_drops", "limit_drops", "syncs")
    return {k: summary.get(k) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="sync/async pairs, alternated")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--shared-cores", action="store_true", help="no pinning: learner and server share all cores")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    learner_cpus = server_cpus = None
    server_env: dict[str, str] = {}
    if not args.shared_cores and len(cores) >= 2:
        learner_cpus, server_cpus = set(cores[:len(cores) // 2]), set(cores[len(cores) // 2:])
        # vLLM's CPU worker binds its threads itself: to the server's cores, not every core.
        server_env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(server_cpus)))

    from omni_engine.models.prepare import prepare_model
    from omni_engine.rl.serve import rollout_server

    checkpoint = next(prepare_model("smollm2", progress=progress).glob("*.safetensors"))
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="bench_actor_learner_") as tmp:
        progress("starting omni-engine serve")
        with rollout_server(PIPELINE, "smollm2", Path(tmp) / "server.log", server_cpus, server_env) as url:
            for round_ in range(args.rounds):
                for mode in ("sync", "async"):
                    progress(f"round {round_ + 1}: {mode} loop, {args.steps} steps, {args.ranks} ranks")
                    summary = run_example(url, mode == "async", args, Path(tmp) / f"{mode}{round_}", learner_cpus)
                    runs[mode].append(figures(summary))
                    progress(f"  {json.dumps(figures(summary))}")
                    restore(url, checkpoint)
    speedups = [a["steps_per_s"] / s["steps_per_s"] for s, a in zip(runs["sync"], runs["async"])]
    result = {"machine": machine_info(), "steps": args.steps, "ranks": args.ranks,
              "cores": {"learner": sorted(learner_cpus or cores), "server": sorted(server_cpus or cores)}, "settings": {**BASE, **dict(
        pair.split("=", 1) for pair in args.set)}, "runs": runs, "speedup": [round(x, 3) for x in speedups],
        "target": ">= 1.6x steps per second"}
    print(json.dumps({"speedup": result["speedup"], "sync": runs["sync"], "async": runs["async"]}, indent=1))
    write_json(RESULTS / "actor_learner.json", result)


if __name__ == "__main__":
    main()
