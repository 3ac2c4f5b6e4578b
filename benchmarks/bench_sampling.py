#!/usr/bin/env python
"""Rollout sampling (``omni_engine.sampling``): what the samplers cost, and what a resume repeats.

    python benchmarks/bench_sampling.py [--quick] [--items 96] [--concurrency 16] [--rounds 3]

SmolLM2-135M (stage_configs/smollm2_text.yaml), greedy, 64 tokens, short chat
questions. Ratios of median completion tokens/s, the two sides taking turns
(A, B, A, B ...) on the same items, so the noise of this shared machine hits both:

1. ``EngineSampler.sample_batch`` vs C asyncio workers calling
   ``MultiStageEngineClient.generate`` with the same prompt ids and params,
   one client shared (target >= 0.95);
2. ``OpenAISampler`` against ``omni-engine serve`` vs against plain vLLM's
   OpenAI server with the same engine args (target >= 0.97), same greedy texts;
3. ``omni-engine sample`` killed (``kill -9``) mid-shard and rerun: requests
   sent again, counted at the server, <= concurrency x answers per request; the
   resumed lines equal an uninterrupted run's.

Writes ``benchmarks/results/sampling.json`` and ``sampling.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    REPO,
    RESULTS,
    machine_info,
    new_figure,
    progress,
    save_figure,
    stop_process_groups,
    write_json,
)

PIPELINE = REPO / "stage_configs" / "smollm2_text.yaml"
CLI = [sys.executable, "-m", "omni_engine.entrypoints.cli.main"]
MODEL = "smollm2"
TARGETS = {"engine_vs_direct": 0.95, "serve_vs_vllm": 0.97}
# Requests counted at the server: SUBMITTED (the orchestrator's count of requests sent to the stage's
# engine, however they end). vLLM's own SUCCESS misses those the killed client's disconnect aborted:
# AsyncLLM.abort drops the request's state before any finish is recorded, so no finished_reason="abort"
# sample appears (vllm 0.32; measured: "not_in_success" in the JSON). SUCCESS is recorded beside it.
SUBMITTED = "omni_engine_stage_requests_total"
SUCCESS = "vllm:request_success_total"
FACTS = [("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
         ("How many legs does a spider have?", "8"), ("What color is a clear daytime sky?", "blue"),
         ("What is the largest planet in the solar system?", "Jupiter"), ("How many days are in a week?", "7"),
         ("What gas do plants take in from the air?", "carbon dioxide"), ("Who wrote Romeo and Juliet?", "Shakespeare"),
         ("What is the boiling point of water in Celsius?", "100"), ("How many continents are there?", "7"),
         ("What is the chemical symbol for gold?", "Au"), ("Which ocean is the largest?", "Pacific")]

Run = Callable[[], Awaitable[tuple[int, dict[str, str]]]]


def make_items(n: int) -> list[dict[str, Any]]:
    """Half arithmetic (varied operands), half facts: varied prompt and answer lengths."""
    items = []
    for i in range(n):
        if i % 2:
            question, answer = FACTS[(i // 2) % len(FACTS)]
        else:
            a, b, op = 3 + i % 17, 2 + (i * 7) % 13, ("plus", "times", "minus")[(i // 2) % 3]
            question, answer = f"What is {a} {op} {b}?", str({"plus": a + b, "times": a * b, "minus": a - b}[op])
        items.append({"id": f"q{i}", "messages": [{"role": "user", "content": question}],
                      "metadata": {"answer": answer}})
    return items


async def alternate(sides: dict[str, Run], rounds: int) -> tuple[dict[str, list[float]], dict[str, dict[str, str]]]:
    """Each side in turn, ``rounds`` times: completion tokens/s per round, and each side's last texts."""
    tps: dict[str, list[float]] = {name: [] for name in sides}
    texts: dict[str, dict[str, str]] = {}
    for r in range(rounds):
        for name, run in sides.items():
            t0 = time.perf_counter()
            tokens, texts[name] = await run()
            tps[name].append(tokens / (time.perf_counter() - t0))
            progress(f"  round {r + 1}/{rounds} {name}: {tps[name][-1]:.1f} tok/s")
    return tps, texts


def comparison(tps: dict[str, list[float]], texts: dict[str, dict[str, str]], target: float) -> dict[str, Any]:
    """Ratio of median throughputs (robust to one disturbed round), and how many greedy texts agree."""
    (base, a), (ours, b) = tps.items()
    ratio = statistics.median(b) / statistics.median(a)
    same = sum(texts[base][k] == texts[ours].get(k) for k in texts[base])
    return {"sides": [base, ours], "tokens_per_s": tps,
            "median": {base: statistics.median(a), ours: statistics.median(b)}, "ratio": ratio,
            "target": target, "met": ratio >= target, "same_texts": f"{same}/{len(texts[base])}"}


async def engine_part(args: argparse.Namespace, items: list[dict[str, Any]]) -> dict[str, Any]:
    """EngineSampler vs the bare client: the sampler's scheduling, rendering and bookkeeping cost."""
    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
    from omni_engine.sampling import SamplerConfig
    from omni_engine.sampling.engine_sampler import EngineSampler
    from omni_engine.sampling.items import item_seed

    async with await MultiStageEngineClient.from_config(PIPELINE, progress=progress) as client:
        sampler = EngineSampler(SamplerConfig(kind="engine", pipeline=str(PIPELINE), temperature=0.0,
                                              max_tokens=args.max_tokens, concurrency=args.concurrency), client=client)
        await sampler.initialize()
        prompts = [await sampler.render(item["messages"]) for item in items]
        # The params the sampler sends: n=1, FINAL_ONLY, the item's round-0 seed.
        params = [sampler.sampling_params(1, item_seed(0, item["id"], 0)) for item in items]
        calls = iter(range(1 << 30))

        async def direct() -> tuple[int, dict[str, str]]:
            todo, texts, tokens = list(range(len(items)))[::-1], {}, [0]

            async def worker() -> None:
                while todo:
                    i, final = todo.pop(), None
                    async for output in client.generate({"prompt_token_ids": prompts[i]}, params[i],
                                                        f"direct-{next(calls)}"):
                        final = output
                    texts[items[i]["id"]] = final.outputs[0].text
                    tokens[0] += len(final.outputs[0].token_ids)

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            return tokens[0], texts

        await sampler.sample_batch(items[:args.concurrency], 1)  # warm-up
        tps, texts = await alternate({"client.generate": direct, "EngineSampler": lambda: sample(sampler, items)},
                                     args.rounds)
        await sampler.shutdown()
    return comparison(tps, texts, TARGETS["engine_vs_direct"])


async def sample(sampler: Any, items: list[dict[str, Any]]) -> tuple[int, dict[str, str]]:
    """One ``sample_batch``: its completion tokens and texts."""
    result = await sampler.sample_batch(items, 1)
    if result.errors:
        raise RuntimeError(f"sampling errors: {result.errors}")
    tokens = sum(r.completion_tokens or 0 for responses in result.values() for r in responses)
    return tokens, {item_id: responses[0].text for item_id, responses in result.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode()
    except OSError:
        return None


def vllm_flags(engine_args: dict[str, Any]) -> list[str]:
    """The stage's engine args (model aside) as ``vllm serve`` flags."""
    flags: list[str] = []
    for key, value in engine_args.items():
        if key != "model" and value is not False:
            flags += ["--" + key.replace("_", "-")] + ([] if value is True else [str(value)])
    return flags


@contextlib.contextmanager
def servers(tmp: Path) -> Iterator[dict[str, str]]:
    """``omni-engine serve`` and plain vLLM's server, both healthy; SIGTERM to their groups at the end."""
    import yaml

    from omni_engine.models.prepare import prepare_model

    engine_args = yaml.safe_load(PIPELINE.read_text())["stage_args"][0]["engine_args"]
    ports = {"vLLM server": free_port(), "omni-engine serve": free_port()}
    cmds = {"vLLM server": [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                            str(prepare_model(MODEL)), "--host", "127.0.0.1", *vllm_flags(engine_args)],
            "omni-engine serve": [*CLI, "serve", str(PIPELINE)]}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, cmd in cmds.items():
            with open(tmp / f"{name.split()[0]}.log", "wb") as log:
                procs[name] = subprocess.Popen([*cmd, "--port", str(ports[name]), "--served-model-name", MODEL],
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 900
        for name, proc in procs.items():
            while http_get(f"http://127.0.0.1:{ports[name]}/health") is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (tmp / f"{name.split()[0]}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{name} did not come up (exit {proc.poll()}):\n{tail}")
                time.sleep(1)
            progress(f"{name} healthy on port {ports[name]}")
        yield {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    finally:
        stop_process_groups(procs.values())


async def serve_part(args: argparse.Namespace, items: list[dict[str, Any]], urls: dict[str, str]) -> dict[str, Any]:
    """The same OpenAISampler against both servers: what omni-engine serve's pipeline layer costs."""
    from omni_engine.sampling import SamplerConfig
    from omni_engine.sampling.openai_sampler import OpenAISampler

    samplers = {name: OpenAISampler(SamplerConfig(kind="openai", base_url=f"{url}/v1", model=MODEL, temperature=0.0,
                                                  max_tokens=args.max_tokens, concurrency=args.concurrency))
                for name, url in urls.items()}
    try:
        for sampler in samplers.values():
            await sampler.initialize()
            await sampler.sample_batch(items[:args.concurrency], 1)  # warm-up
        tps, texts = await alternate({name: (lambda s=s: sample(s, items)) for name, s in samplers.items()},
                                     args.rounds)
    finally:
        for sampler in samplers.values():
            await sampler.shutdown()
    return comparison(tps, texts, TARGETS["serve_vs_vllm"])


def counters(url: str) -> dict[str, float]:
    """The server's request counters: SUBMITTED, and SUCCESS summed and per finished_reason."""
    found: dict[str, float] = {}
    for line in (http_get(f"{url}/metrics", timeout=30) or "").splitlines():
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        if name in (SUBMITTED, SUCCESS) and not line.startswith("#"):
            reason = re.search(r'finished_reason="([^"]*)"', series)
            for key in (name, f"{name}:{reason.group(1)}" if reason else None):
                if key:
                    found[key] = found.get(key, 0.0) + float(value)
    if SUBMITTED not in found:
        raise RuntimeError(f"{url}/metrics has no {SUBMITTED}")
    return found


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    """What each counter rose by between two scrapes."""
    return {k: int(v - before.get(k, 0.0)) for k, v in after.items() if v != before.get(k, 0.0)}


def run_cli(config: Path, log: Path) -> subprocess.Popen:
    """``omni-engine sample`` in its own session, so a kill of its group takes everything it started."""
    with open(log, "ab") as out:
        return subprocess.Popen([*CLI, "sample", "--config", str(config), "--no-progress"], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def kill_mid_shard(config: Path, out: Path, log: Path) -> int:
    """Start a run and ``kill -9`` its group once shard 0 is out and shard 1 has journaled a few requests."""
    proc, journal, deadline = run_cli(config, log), out / "shard_00001.journal", time.monotonic() + 600
    while not ((out / "shard_00000.jsonl").exists() and journal.exists()
               and (lines := journal.read_bytes().count(b"\n")) >= 3):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended or stalled before the kill:\n{log.read_text()[-3000:]}")
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    return lines


def resume_part(args: argparse.Namespace, items: list[dict[str, Any]], url: str, tmp: Path) -> dict[str, Any]:
    """Requests sent again after a kill -9 mid-shard: engine-counted (killed + resumed) - uninterrupted."""
    import yaml

    from omni_engine.sampling.pipeline import output_lines

    (tmp / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    step = 1
    base = {"sampler": {"kind": "openai", "base_url": f"{url}/v1", "model": MODEL, "concurrency": args.concurrency,
                        "temperature": 0.0, "max_tokens": args.max_tokens},
            "sampling": {"step_size": step, "max_rollouts": 2, "max_steps": 2},
            "shard": {"size": max(1, len(items) // 4)}, "input": {"path": "items.jsonl"}}
    for name in ("whole", "killed"):
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump({**base, "output": {"dir": name}}))
    log = tmp / "cli.log"
    m0 = counters(url)
    if run_cli(tmp / "whole.yaml", log).wait(1800) != 0:
        raise RuntimeError(f"uninterrupted run failed:\n{log.read_text()[-3000:]}")
    m1 = counters(url)
    whole = json.loads((tmp / "whole" / "manifest.json").read_text())["summary"]
    probes = int(m1[SUBMITTED] - m0[SUBMITTED]) - whole["requests"]  # initialize()'s test request, per run
    journaled = kill_mid_shard(tmp / "killed.yaml", tmp / "killed", log)
    time.sleep(2)  # the server sees the disconnects and aborts
    m2 = counters(url)
    if run_cli(tmp / "killed.yaml", log).wait(1800) != 0:
        raise RuntimeError(f"resumed run failed:\n{log.read_text()[-3000:]}")
    m3 = counters(url)
    resumed = json.loads((tmp / "killed" / "manifest.json").read_text())["summary"]
    repeated = int(m3[SUBMITTED] - m1[SUBMITTED]) - 2 * probes - whole["requests"]
    same = (sorted(json.dumps(x, sort_keys=True) for x in output_lines(tmp / "whole"))
            == sorted(json.dumps(x, sort_keys=True) for x in output_lines(tmp / "killed")))
    bound, both = args.concurrency * step, delta(m3, m1)
    return {"uninterrupted_requests": whole["requests"], "probe_requests_per_run": probes,
            "journal_lines_at_kill": journaled, "engine_killed": delta(m2, m1), "engine_resumed": delta(m3, m2),
            "not_in_success": both.get(SUBMITTED, 0) - both.get(SUCCESS, 0),
            "resumed_summary": resumed, "repeated": repeated, "bound": bound, "met": 0 <= repeated <= bound,
            "same_lines": same}


def plot(results: dict[str, Any], path: Path) -> None:
    """Both sides of each comparison (median bars, rounds as dots), and the resume's request counts."""
    fig, axes = new_figure(3, width=4.6)
    for ax, key in zip(axes, ("engine", "serve")):
        r = results[key]
        ax.bar(r["sides"], [r["median"][s] for s in r["sides"]], color=["#8c8c8c", "#4c72b0"])
        for i, side in enumerate(r["sides"]):
            ax.plot([i] * len(r["tokens_per_s"][side]), r["tokens_per_s"][side], "k.")
        ax.set_title(f"{r['ratio']:.3f}x (target {r['target']})")
        ax.set_ylabel("completion tokens/s (median; dots: rounds)")
    r = results["resume"]
    axes[2].bar(["uninterrupted", "killed + resumed"], [r["uninterrupted_requests"],
                r["uninterrupted_requests"] + r["repeated"]], color=["#8c8c8c", "#c44e52"])
    axes[2].set_title(f"{r['repeated']} requests repeated (bound {r['bound']})")
    axes[2].set_ylabel("requests at the engine")
    save_figure(fig, path)


def summary(results: dict[str, Any]) -> None:
    print(f"\n{'comparison':<44} {'base tok/s':>10} {'ours tok/s':>10} {'ratio':>7} {'target':>7}  met  same texts")
    for key in ("engine", "serve"):
        r = results[key]
        a, b = r["sides"]
        print(f"{b + ' vs ' + a:<44} {r['median'][a]:>10.1f} {r['median'][b]:>10.1f} {r['ratio']:>7.3f} "
              f"{'>= ' + str(r['target']):>7}  {'yes' if r['met'] else 'NO':<4} {r['same_texts']}")
    r = results["resume"]
    print(f"resume after kill -9: {r['repeated']} requests repeated (bound {r['bound']}: "
          f"{'met' if r['met'] else 'NOT met'}); uninterrupted {r['uninterrupted_requests']} requests; "
          f"resumed lines == uninterrupted: {r['same_lines']}; took {results['seconds']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 items, 2 rounds: a smoke test")
    parser.add_argument("--items", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.quick:
        args.items, args.rounds = min(args.items, 16), min(args.rounds, 2)
    started, items = time.perf_counter(), make_items(args.items)
    results: dict[str, Any] = {"engine": asyncio.run(engine_part(args, items))}
    with tempfile.TemporaryDirectory(prefix="bench_sampling-") as tmp, servers(Path(tmp)) as urls:
        results["serve"] = asyncio.run(serve_part(args, items, urls))
        results["resume"] = resume_part(args, items, urls["omni-engine serve"], Path(tmp))
    results["seconds"] = time.perf_counter() - started
    write_json(RESULTS / "sampling.json", {"benchmark": "bench_sampling", "machine": machine_info(),
                                           "params": vars(args), **results})
    plot(results, RESULTS / "sampling.png")
    summary(results)


if __name__ == "__main__":
    main()
