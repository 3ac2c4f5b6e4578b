#!/usr/bin/env python
"""Start-up and restart: how long until a pipeline serves, side by side with vLLM's own server.

    python benchmarks/bench_startup.py [--rounds 3] [--restarts 3] [--only servers,stages,llm,restart]

In one run (these machines are shared and noisy: the figures to compare are those of one run),
median of ``--rounds`` each, the servers taking turns:

* servers: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on the
  prepared SmolLM2 with the engine arguments of ``smollm2_text.yaml``, against ``omni-engine
  serve`` of ``smollm2_text.yaml``, ``smollm2_speech.yaml`` and ``smollm2_piper.yaml``: seconds
  from the command to ``/health`` 200, and the RSS of every process of the server then;
  ``omni-text-fork`` and ``omni-text-spawn`` are ``smollm2_text.yaml`` with
  ``OMNI_ENGINE_WARM_ENGINE_CORE=fork`` (the stage forks its EngineCore) and ``=0`` (vLLM spawns it
  after the stage's import, as before the warm forkserver);
* stages: each generation stage kind alone (eSpeak NG, Piper voice, eye GAN), from
  ``StageEngineCoreClient.start()`` to READY, its RSS and whether it loaded vLLM or torch;
* llm: the SmolLM2 llm stage alone to READY, its EngineCore forked by the warm forkserver, forked by
  the stage, or spawned by vLLM (taking turns), the RSS of each process of the stage, and then its
  decode throughput (32 answers of 160 tokens at once);
* restart: a one-replica stage with ``restart: on-failure`` is killed (``kill -9``) and the time
  to its replacement's READY and to the next request served is taken; for eSpeak and for the
  SmolLM2 llm stage (compared with the llm stage's cold start), and for that llm stage with
  ``runtime.warm_spare`` (killed once its spare waits; the spare's RSS and USS then).

Writes JSON to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import REPO, RESULTS, machine_info, progress, write_json  # noqa: E402
from omni_engine.envs import ENGINE_CORE_STARTS  # noqa: E402

OMNI = [sys.executable, "-m", "omni_engine.entrypoints.cli.main", "serve"]
SERVE_CONFIGS = {"omni-text": "stage_configs/smollm2_text.yaml", "omni-speech": "stage_configs/smollm2_speech.yaml",
                 "omni-piper": "stage_configs/smollm2_piper.yaml", "omni-text-fork": "stage_configs/smollm2_text.yaml",
                 "omni-text-spawn": "stage_configs/smollm2_text.yaml"}
# Environment a server variant runs with (the others: this process's).
SERVE_ENV = {"omni-text-fork": {"OMNI_ENGINE_WARM_ENGINE_CORE": "fork"},
             "omni-text-spawn": {"OMNI_ENGINE_WARM_ENGINE_CORE": "0"}}
STAGE_KINDS = {
    "espeak": ("omni_engine.engines.tts:make_espeak_tts", None),
    "piper-voice": ("omni_engine.engines.piper:make_piper_voice", "piper-joe"),
    "eye-gan": ("omni_engine.engines.gan_image:make_eye_gan", "gan-eyes"),
}
READY_TIMEOUT_S = 600


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout: float = READY_TIMEOUT_S) -> None:
    """Return once the server of ``proc`` answers /health with 200; fails naming its log if it exits
    or is not healthy within ``timeout`` seconds."""
    deadline = time.perf_counter() + timeout
    while not healthy(f"http://127.0.0.1:{port}/health"):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}; see {log}")
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{proc.args[:4]} not healthy after {timeout:.0f} s; see {log}")
        time.sleep(0.1)


def tree_rss_mib(pid: int) -> dict[str, float]:
    """RSS (and USS) of a process and its descendants, by what ``top`` calls them (omni-stage<N>,
    VLLM::EngineCore, the forkserver)."""
    import psutil

    found: dict[str, float] = {}
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = proc.name()
            if name.startswith("python") and "resource_tracker" in " ".join(proc.cmdline()):
                continue
            if "multiprocessing.forkserver" in " ".join(proc.cmdline()):
                name = "forkserver"
            label = "server" if proc.pid == pid else name
            found[label] = found.get(label, 0.0) + proc.memory_info().rss / 2**20
            # Memory only this process holds: a forked EngineCore shares its imports with the forkserver.
            found[f"{label} (uss)"] = found.get(f"{label} (uss)", 0.0) + proc.memory_full_info().uss / 2**20
        except psutil.Error:
            continue
    return found


def vllm_server_cmd(model: Path, port: int) -> list[str]:
    """vLLM's own server with the engine arguments of smollm2_text.yaml."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "smollm2", "--port", str(port), "--max-model-len", "2048",
            "--max-num-seqs", "16", "--enforce-eager", "--dtype", "float32", "--gpu-memory-utilization", "0.3"]


def time_server(cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Seconds from the command to /health 200, and the RSS of its processes then."""
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    try:
        wait_healthy(proc, port, log, READY_TIMEOUT_S - (time.perf_counter() - t0))
        ready_s = time.perf_counter() - t0
        return {"ready_s": ready_s, "rss_mib": tree_rss_mib(proc.pid)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def servers(rounds: int, model: Path, log_dir: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"vllm": [], **{name: [] for name in SERVE_CONFIGS}}
    for r in range(rounds):
        names = list(runs) if r % 2 == 0 else list(reversed(runs))  # alternate who goes first
        for name in names:
            port = free_port()
            cmd = vllm_server_cmd(model, port) if name == "vllm" else [*OMNI, SERVE_CONFIGS[name], "--port", str(port)]
            found = time_server(cmd, port, log_dir / f"{name}-{r}.log", SERVE_ENV.get(name))
            runs[name].append(found)
            progress(f"round {r + 1}/{rounds}: {name} ready in {found['ready_s']:.1f} s")
    result = {name: {"ready_s": [x["ready_s"] for x in v], "median_s": statistics.median(x["ready_s"] for x in v),
                     "rss_mib": v[-1]["rss_mib"]} for name, v in runs.items()}
    base = result["vllm"]["median_s"]
    for name in SERVE_CONFIGS:
        result[name]["vs_vllm"] = result[name]["median_s"] / base
    return result


def stage_spec(factory: str, recipe: str | None):
    from omni_engine.models.prepare import prepare_model
    from omni_engine.stage_engine.stage_process import StageProcessSpec

    args: dict[str, Any] = {"model_factory": factory}
    if recipe is not None:
        args["model"] = str(prepare_model(recipe))
    return StageProcessSpec("generation", args, max_batch_size=4)


async def stages(rounds: int) -> dict[str, Any]:
    import psutil

    from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient

    result: dict[str, Any] = {}
    for kind, (factory, recipe) in STAGE_KINDS.items():
        spec = stage_spec(factory, recipe)
        times, rss, loaded = [], [], []
        for _ in range(rounds):
            client = StageEngineCoreClient(0, process=spec)
            t0 = time.perf_counter()
            await client.start()
            times.append(time.perf_counter() - t0)
            rss.append(psutil.Process(client.process.pid).memory_info().rss / 2**20)
            loaded = await client.call_utility_async("loaded_packages")
            await client.shutdown()
        result[kind] = {"ready_s": times, "median_s": statistics.median(times), "rss_mib": statistics.median(rss),
                        "loads_vllm": "vllm" in loaded, "loads_torch": "torch" in loaded}
        progress(f"{kind}: ready in {statistics.median(times):.2f} s, {statistics.median(rss):.0f} MiB")
    return result


def llm_engine_args(model: Path) -> dict[str, Any]:
    """The engine arguments of smollm2_text.yaml's stage."""
    return {"model": str(model), "max_model_len": 2048, "max_num_seqs": 16, "enforce_eager": True,
            "dtype": "float32", "gpu_memory_utilization": 0.3}


async def decode_tokens_per_s(client: Any) -> float:
    """32 answers of 160 tokens at once through a started llm stage: generated tokens per second."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    started, tokens, done = time.perf_counter(), 0, 0
    for i in range(32):
        await client.submit_request(f"decode-{i}", {"prompt": f"Count to {i + 10}:"}, params)
    while done < 32:
        for output in await client.get_outputs_async():
            if output.finished:
                done, tokens = done + 1, tokens + len(output.outputs[0].token_ids)
    return tokens / (time.perf_counter() - started)


async def llm_stage(rounds: int, model: Path) -> dict[str, Any]:
    """The llm stage alone to READY, then its decode throughput, for each way of starting vLLM's
    EngineCore (forkserver, fork, spawn), taking turns."""
    from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
    from omni_engine.stage_engine.stage_process import StageProcessSpec

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ENGINE_CORE_STARTS}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            spec = StageProcessSpec("llm", llm_engine_args(model), engine_core_start=name)
            client = StageEngineCoreClient(0, process=spec)
            t0 = time.perf_counter()
            await client.start()
            ready_s = time.perf_counter() - t0
            rss = tree_rss_mib(client.process.pid)
            tokens_per_s = await decode_tokens_per_s(client)
            runs[name].append({"ready_s": ready_s, "rss_mib": rss, "tokens_per_s": tokens_per_s})
            await client.shutdown()
            progress(f"round {r + 1}/{rounds}: llm stage ({name}) ready in {ready_s:.1f} s, "
                     f"{tokens_per_s:.0f} tokens/s")
    result: dict[str, Any] = {
        name: {"ready_s": [x["ready_s"] for x in v], "median_s": statistics.median(x["ready_s"] for x in v),
               "tokens_per_s": [x["tokens_per_s"] for x in v],
               "median_tokens_per_s": statistics.median(x["tokens_per_s"] for x in v), "rss_mib": v[-1]["rss_mib"]}
        for name, v in runs.items()}
    for name in ("forkserver", "fork"):
        result[f"{name}_vs_spawn"] = result[name]["median_s"] / result["spawn"]["median_s"]
    progress("llm stage ready (median): " + ", ".join(
        f"{name} {result[name]['median_s']:.1f} s, {result[name]['median_tokens_per_s']:.0f} tokens/s"
        for name in runs))
    return result


def one_stage_config(stage: dict[str, Any]):
    from omni_engine.config import parse_pipeline_config

    return parse_pipeline_config({"stage_args": [{"stage_id": 0, "final_output": True, **stage}]}, "<bench_startup>")


async def restart(kind: str, config, prompt: Any, params: Any, trials: int) -> dict[str, Any]:
    """Per trial: seconds from kill -9 of the stage to its replacement's READY and to a request served."""
    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient

    t0 = time.perf_counter()
    client = await MultiStageEngineClient.from_config(config)
    cold_s = time.perf_counter() - t0
    found: dict[str, Any] = {"cold_start_s": cold_s, "ready_s": [], "served_s": []}
    try:
        for trial in range(trials):
            async for _ in client.generate(prompt, params, f"{kind}-warm-{trial}"):
                pass
            if config.stage_args[0].runtime.warm_spare:
                # The steady state: a spare that has imported everything waits.
                while (spare := client.supervisor.spares.get(0)) is None:
                    await asyncio.sleep(0.05)  # started a while after a restart
                spare_ready_s = await wait_spare_ready(spare.process.log_path)
                found.setdefault("spare_ready_s", []).append(spare_ready_s)
                found.setdefault("spare_rss_mib", []).append(tree_rss_mib(spare.process.pid))
            pid = client.replica_status(0)[0].pid
            t_kill = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            while not ((status := client.replica_status(0)[0]).alive and status.pid != pid):
                await asyncio.sleep(0.01)  # a benchmark may poll what it measures
            found["ready_s"].append(time.perf_counter() - t_kill)
            async for _ in client.generate(prompt, params, f"{kind}-after-{trial}"):
                pass
            found["served_s"].append(time.perf_counter() - t_kill)
            progress(f"{kind} restart {trial + 1}/{trials}: ready {found['ready_s'][-1]:.2f} s, "
                     f"served {found['served_s'][-1]:.2f} s after kill -9 (cold start {cold_s:.1f} s)")
    finally:
        await client.shutdown_async()
    found["median_served_s"] = statistics.median(found["served_s"])
    found["served_vs_cold"] = found["median_served_s"] / cold_s
    return found


async def wait_spare_ready(log: Path) -> float:
    """Seconds until a warm spare's log says it waits (it says how long its imports took)."""
    import re

    t0 = time.perf_counter()
    while not (log.exists() and (m := re.search(r"ready in ([0-9.]+) s; waiting", log.read_text()))):
        await asyncio.sleep(0.05)
    progress(f"warm spare ready ({m.group(1)} s of imports; waited {time.perf_counter() - t0:.1f} s)")
    return float(m.group(1))


async def restarts(trials: int, model: Path) -> dict[str, Any]:
    from vllm import SamplingParams

    espeak = one_stage_config({"stage_type": "generation", "final_output_type": "audio",
                               "engine_args": {"model_factory": STAGE_KINDS["espeak"][0]},
                               "runtime": {"restart": "on-failure", "max_restarts": trials}})
    llm = one_stage_config({"stage_type": "llm", "final_output_type": "text",
                            "engine_args": llm_engine_args(model),
                            "runtime": {"restart": "on-failure", "max_restarts": trials}})
    llm_spare = one_stage_config({"stage_type": "llm", "final_output_type": "text",
                                  "engine_args": llm_engine_args(model),
                                  "runtime": {"restart": "on-failure", "max_restarts": trials, "warm_spare": True}})
    return {"espeak": await restart("espeak", espeak, "Back in service.", None, trials),
            "llm": await restart("llm", llm, "Hello", SamplingParams(max_tokens=4), trials),
            "llm-warm-spare": await restart("llm-warm-spare", llm_spare, "Hello", SamplingParams(max_tokens=4), trials)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--only", default="servers,stages,llm,restart")
    parser.add_argument("--json", default=str(RESULTS / "bench_startup.json"))
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from omni_engine.models.prepare import prepare_model

    model = prepare_model("smollm2")
    log_dir = RESULTS / "bench_startup_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    results: dict[str, Any] = {"machine": machine_info(), "rounds": args.rounds}
    if "stages" in only:
        results["stages"] = asyncio.run(stages(args.rounds))
    if "llm" in only:
        results["llm"] = asyncio.run(llm_stage(args.rounds, model))
    if "restart" in only:
        results["restart"] = asyncio.run(restarts(args.restarts, model))
    if "servers" in only:
        results["servers"] = servers(args.rounds, model, log_dir)
        for name in SERVE_CONFIGS:
            s = results["servers"][name]
            progress(f"{name}: {s['median_s']:.1f} s, {s['vs_vllm']:.2f}x vLLM's own server "
                     f"({results['servers']['vllm']['median_s']:.1f} s)")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
