"""Abort storm: N requests through the speech pipeline, random aborts at random points.

    PYTHONPATH=. python tests/stress/abort_storm.py --requests 1000 --concurrency 8 --seed 0 [--legacy]

Afterwards nothing may hold request state (the orchestrator, the stage
clients, the lease book, every stage process), the speech stage's shared-
memory pool must have every slot back, and once the pipeline is shut down no
process, socket directory or segment of this run may remain. Requests that
were not aborted must have finished with text and audio. Prints a JSON
summary; exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tests.stress` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.stress.pipeline import DEFAULT_CONFIG, DEFAULT_SHM_THRESHOLD, set_stress_env_defaults  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--abort-fraction", type=float, default=0.5)
    parser.add_argument("--min-tokens", type=int, default=16, help="smallest max_tokens of a request")
    parser.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens of a request")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--shm-threshold", type=int, default=DEFAULT_SHM_THRESHOLD,
                        help="bytes from which tensors go through shared memory (low: audio does)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one request may take (else: a hang)")
    parser.add_argument("--legacy", action="store_true", help="the multiprocessing.Queue architecture")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    return parser.parse_args(argv)


async def storm(client, args: argparse.Namespace, prompts: list[str]) -> dict:
    """Run the storm on a started pipeline; the summary, with leftovers, before shutdown."""
    from tests.stress.checks import wait_clean
    from tests.stress.storm import make_plans, run_storm, summarize

    plans = make_plans(args.requests, prompts, args.seed, args.abort_fraction, (args.min_tokens, args.max_tokens))
    t0 = time.monotonic()
    outcomes = await run_storm(client, plans, args.concurrency, args.timeout)
    summary = summarize(outcomes)
    summary["duration_s"] = round(time.monotonic() - t0, 1)
    summary["leftovers"] = await wait_clean(client)
    return summary


async def main_async(args: argparse.Namespace) -> dict:
    from omni_engine.connectors.shm import list_segments
    from tests.stress.checks import after_shutdown
    from tests.stress.debug import install_task_dump
    from tests.stress.pipeline import chat_prompts, describe, speech_config, start_pipeline

    install_task_dump()
    config = speech_config(args.config, shm_threshold=args.shm_threshold)
    prompts = chat_prompts(config)
    started = time.monotonic()
    client = await start_pipeline(config, args.legacy)
    summary = {"startup_s": round(time.monotonic() - started, 1), **describe(client),
               "requests": args.requests, "concurrency": args.concurrency, "seed": args.seed}
    try:
        summary.update(await storm(client, args, prompts))
    finally:
        await client.shutdown_async()
    summary["leftovers"] = summary.get("leftovers", []) + await after_shutdown(client)
    ours = list_segments(f"omni_{os.getpid()}_")
    if ours:
        summary["leftovers"].append(f"segments of this run in /dev/shm after shutdown: {ours[:5]}")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_stress_env_defaults()
    import uvloop

    summary = uvloop.run(main_async(args))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 1 if summary["failures"] or summary["leftovers"] else 0


if __name__ == "__main__":
    sys.exit(main())
