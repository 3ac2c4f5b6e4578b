#!/usr/bin/env python
"""What tracing costs a served pipeline: ``omni-engine bench serve`` against the same pipeline
served with ``--otlp-traces-endpoint`` and without, side by side.

    python benchmarks/bench_tracing.py [--config stage_configs/smollm2_speech.yaml] [--rounds 3]
        [--backend openai-chat-audio] [--num-prompts 24] [--max-concurrency 4]

Both servers start first and stay up; the bench then runs against each in turn (``--rounds``
times, alternating who goes first), so both see the same machine. The traced server exports
to an OTLP/HTTP receiver in this process, which decodes what arrives and counts the spans.
Reported: each variant's medians of the bench's figures, and on/off ratios (the target:
throughput >= 0.97x). Writes JSON to ``benchmarks/results/bench_tracing.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    REPO,
    RESULTS,
    machine_info,
    progress,
    stop_process_groups,
    write_json,
)
from benchmarks.bench_startup import free_port, wait_healthy  # noqa: E402

OMNI = [sys.executable, "-m", "omni_engine.entrypoints.cli.main", "serve"]
FIGURES = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "median_ttfa_ms", "audio_throughput")


class SpanCounter:
    """An OTLP/HTTP receiver that decodes each export and counts its spans."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans = 0
        counter = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                counter.spans += sum(len(s.spans) for rs in request.resource_spans for s in rs.scope_spans)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def start_server(config: str, port: int, log: Path, extra: list[str]) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([*OMNI, config, "--port", str(port), "--served-model-name", "smollm2", *extra],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})


def bench(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    from omni_engine.bench.serve_bench import add_arguments, run_benchmark

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    bench_args = parser.parse_args([
        "--base-url", base_url, "--backend", args.backend, "--model", "smollm2", "--num-prompts",
        str(args.num_prompts), "--max-concurrency", str(args.max_concurrency), "--random-output-len",
        str(args.output_len), "--disable-tqdm", "--seed", "0"])
    return asyncio.run(run_benchmark(bench_args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="stage_configs/smollm2_speech.yaml")
    parser.add_argument("--backend", default="openai-chat-audio")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--json", default=str(RESULTS / "bench_tracing.json"))
    args = parser.parse_args()
    log_dir = RESULTS / "bench_tracing_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    counter = SpanCounter()
    ports = {"off": free_port(), "on": free_port()}
    extra = {"off": [], "on": ["--otlp-traces-endpoint", counter.url]}
    procs = {name: start_server(args.config, ports[name], log_dir / f"{name}.log", extra[name]) for name in ports}
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    try:
        for name, proc in procs.items():
            wait_healthy(proc, ports[name], log_dir / f"{name}.log")
        progress("both servers healthy")
        bench(f"http://127.0.0.1:{ports['off']}", argparse.Namespace(**{**vars(args), "num_prompts": 4}))  # warm-up
        bench(f"http://127.0.0.1:{ports['on']}", argparse.Namespace(**{**vars(args), "num_prompts": 4}))
        for r in range(args.rounds):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                result = bench(f"http://127.0.0.1:{ports[name]}", args)
                runs[name].append({k: result.get(k) for k in (*FIGURES, "completed", "failed")})
                progress(f"round {r + 1}/{args.rounds} tracing {name}: "
                         f"{result['request_throughput']:.3f} req/s, {result['output_throughput']:.1f} tok/s, "
                         f"TTFT p50 {result['median_ttft_ms']:.0f} ms")
    finally:
        stop_process_groups(procs.values())
    medians = {name: {k: statistics.median(x[k] for x in v if x.get(k) is not None)
                      for k in FIGURES if any(x.get(k) is not None for x in v)} for name, v in runs.items()}
    ratios = {k: medians["on"][k] / medians["off"][k] for k in medians["off"] if medians["off"][k]}
    results = {"machine": machine_info(), "config": args.config, "backend": args.backend, "rounds": runs,
               "medians": medians, "on_vs_off": ratios, "spans_received": counter.spans}
    progress(f"tracing on vs off: request throughput {ratios['request_throughput']:.3f}x, output throughput "
             f"{ratios['output_throughput']:.3f}x, TTFT p50 {ratios['median_ttft_ms']:.3f}x; "
             f"{counter.spans} spans received")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
