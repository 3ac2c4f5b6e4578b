"""Soak: the speech pipeline at steady concurrency, for a number of requests or a duration.

    PYTHONPATH=. python tests/stress/soak.py --requests 10000 --concurrency 16 --max-tokens 32 --json soak.json

Reports the RSS of every process (the client, each stage, what each stage
started) after a warm-up (allocators and caches settle) and at the end,
requests completed and failed, throughput and latency. Exits 1 on a failed
request or when a process grew by ``--max-rss-growth`` percent or more.
``kill -USR1 <pid>`` prints where every task waits (a hang).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tests.stress` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.stress.pipeline import DEFAULT_CONFIG, DEFAULT_SHM_THRESHOLD, set_stress_env_defaults  # noqa: E402


@dataclass
class SoakReport:
    """What a soak measured; ``to_dict`` is the JSON written."""

    concurrency: int
    warmup: int
    completed: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)  # the first few
    duration_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    rss_start_kib: dict[str, int | None] = field(default_factory=dict)
    rss_end_kib: dict[str, int | None] = field(default_factory=dict)
    # (requests done, RSS per process) every ``sample_every`` requests: the trend, not just two points.
    rss_samples: list[tuple[int, dict[str, int | None]]] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    # CPU seconds each process spent during the measured run: where the time goes.
    cpu_s: dict[str, float | None] = field(default_factory=dict)

    def rss_growth_pct(self) -> dict[str, float | None]:
        from tests.stress.rss import growth

        return growth(self.rss_start_kib, self.rss_end_kib)

    def to_dict(self) -> dict[str, Any]:
        ordered = sorted(self.latencies)
        pick = (lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)) if ordered else None
        return {
            "concurrency": self.concurrency, "warmup_requests": self.warmup,
            "completed": self.completed, "failed": self.failed, "errors": self.errors,
            "duration_s": round(self.duration_s, 1),
            "throughput_rps": round(self.completed / self.duration_s, 2) if self.duration_s else 0.0,
            "latency_s": {"p50": pick(0.5), "p99": pick(0.99), "max": round(ordered[-1], 3)} if ordered else {},
            "rss_start_kib": self.rss_start_kib, "rss_end_kib": self.rss_end_kib,
            "rss_growth_pct": self.rss_growth_pct(), "rss_samples": self.rss_samples, "cpu_s": self.cpu_s,
            "leftovers": self.leftovers,
        }


async def run_requests(client, prompts: list[str], count: int | None, deadline: float | None, concurrency: int,
                       max_tokens: int, prefix: str, on_done=None, timeout: float = 300.0) -> list[Any]:
    """``count`` requests (or as many as fit before ``deadline``, loop time) at ``concurrency``.

    Returns (seconds, problems) per request: an empty ``problems`` is a complete answer.
    """
    from tests.stress.storm import Plan, run_request

    loop = asyncio.get_running_loop()
    outcomes: list[Any] = []
    counter = iter(range(count) if count is not None else iter(int, 1))  # iter(int, 1): endless

    async def worker() -> None:
        for i in counter:
            if deadline is not None and loop.time() >= deadline:
                return
            plan = Plan(f"{prefix}-{i}", prompts[i % len(prompts)], max_tokens)
            outcome = await run_request(client, plan, timeout)
            outcomes.append((outcome.seconds, outcome.problems()))  # the numbers, not the answers
            if on_done is not None:
                on_done(len(outcomes))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


async def soak(client, prompts: list[str], *, requests: int | None, duration: float | None, concurrency: int,
               warmup: int, max_tokens: int, sample_every: int = 0) -> SoakReport:
    """Warm up, measure RSS, run at steady concurrency, measure RSS again."""
    from tests.stress.checks import wait_clean
    from tests.stress.pipeline import stage_pids
    from tests.stress.rss import cpu_snapshot, pipeline_processes, snapshot

    report = SoakReport(concurrency, warmup)
    await run_requests(client, prompts, warmup, None, concurrency, max_tokens, "warmup")
    procs = pipeline_processes(stage_pids(client))
    gc.collect()
    report.rss_start_kib = snapshot(procs)

    loop = asyncio.get_running_loop()

    def on_done(n: int) -> None:
        if sample_every and n % sample_every == 0:
            rss = snapshot(procs)
            report.rss_samples.append((n, rss))
            elapsed = loop.time() - t0
            print(f"[soak] {n} requests in {elapsed:.0f} s ({n / elapsed:.2f}/s); RSS KiB {rss}",
                  file=sys.stderr, flush=True)

    cpu_start = cpu_snapshot(procs)
    t0 = loop.time()
    deadline = t0 + duration if duration is not None else None
    outcomes = await run_requests(client, prompts, requests, deadline, concurrency, max_tokens, "soak", on_done)
    report.duration_s = loop.time() - t0
    report.cpu_s = {name: round(end - cpu_start[name], 1) if end is not None and cpu_start[name] is not None
                    else None for name, end in cpu_snapshot(procs).items()}
    for seconds, problems in outcomes:
        if problems:
            report.failed += 1
            report.errors.extend(problems[: max(0, 10 - len(report.errors))])
        else:
            report.completed += 1
            report.latencies.append(seconds)
    report.leftovers = await wait_clean(client)
    gc.collect()
    report.rss_end_kib = snapshot(procs)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    amount = parser.add_mutually_exclusive_group(required=True)
    amount.add_argument("--requests", type=int, help="requests after the warm-up")
    amount.add_argument("--duration", type=float, help="seconds to run after the warm-up")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=200, help="requests before RSS is first measured")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--shm-threshold", type=int, default=DEFAULT_SHM_THRESHOLD,
                        help="bytes from which tensors go through shared memory (low: audio does)")
    parser.add_argument("--legacy", action="store_true", help="the multiprocessing.Queue architecture")
    parser.add_argument("--max-rss-growth", type=float, default=5.0, help="percent; at or above it, exit 1")
    parser.add_argument("--samples", type=int, default=10, help="RSS samples during the run")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    return parser.parse_args(argv)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from omni_engine.entrypoints.signals import cancel_on_signals
    from tests.stress.checks import after_shutdown
    from tests.stress.debug import install_task_dump
    from tests.stress.pipeline import chat_prompts, describe, speech_config, start_pipeline

    install_task_dump()
    cancel_on_signals()
    config = speech_config(args.config, shm_threshold=args.shm_threshold)
    prompts = chat_prompts(config)
    started = time.monotonic()
    client = await start_pipeline(config, args.legacy)
    result: dict[str, Any] = {"startup_s": round(time.monotonic() - started, 1), **describe(client),
                              "config": str(args.config), "max_tokens": args.max_tokens}
    sample_every = max(1, (args.requests or 0) // args.samples) if args.requests and args.samples else 0
    try:
        report = await soak(client, prompts, requests=args.requests, duration=args.duration,
                            concurrency=args.concurrency, warmup=args.warmup, max_tokens=args.max_tokens,
                            sample_every=sample_every)
        result.update(report.to_dict())
    finally:
        await client.shutdown_async()
    result["leftovers"] = result.get("leftovers", []) + await after_shutdown(client)
    return result


def verdict(result: dict[str, Any], max_growth: float) -> list[str]:
    """Why this soak failed (empty: it passed)."""
    found = [f"{result['failed']} request(s) failed"] if result["failed"] else []
    found += [f"{name} grew {pct} % (limit {max_growth} %)" for name, pct in result["rss_growth_pct"].items()
              if pct is not None and pct >= max_growth]
    return found + result["leftovers"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_stress_env_defaults()
    import uvloop

    result = uvloop.run(main_async(args))
    result["violations"] = verdict(result, args.max_rss_growth)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
