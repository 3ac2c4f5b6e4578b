"""``omni-engine bench serve``: requests at a rate (Poisson, or all at once) and a concurrency
limit, against any OpenAI-compatible server; vLLM's figures and flags, audio's figures beside."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from omni_engine.bench.backends import (
    BACKENDS,
    SPEECH_IN,
    BenchSettings,
    RequestResult,
    prepare_audio,
)
from omni_engine.bench.datasets import (
    BenchRequest,
    DatasetError,
    custom_requests,
    random_requests,
)
from omni_engine.bench.results import PER_REQUEST_KEYS, per_request, summarize
from omni_engine.entrypoints.cli.common import json_object


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``vllm bench serve``'s flags, where they mean the same."""
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="openai-chat")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    parser.add_argument("--endpoint", default=None, help="the API path (default: the backend's)")
    parser.add_argument("--model", default=None, help="the served model (default: the server's first)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--dataset-name", choices=("random", "custom"), default="random")
    parser.add_argument("--dataset-path", type=Path, default=None, help="custom: a JSONL of {'prompt': ...} lines")
    parser.add_argument("--random-input-len", type=int, default=32, help="random: words per prompt")
    parser.add_argument("--random-output-len", type=int, default=128, help="max_tokens per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--voice", default=None, help="audio backends: the voice")
    parser.add_argument("--speech-format", choices=("wav", "pcm"), default="wav",
                        help="openai-speech: the response_format asked for (both are timed as their bytes arrive; "
                             "pcm is what OpenAI's clients stream to a player)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--extra-body", type=json_object, default=None, metavar="JSON",
                        help="chat backends: a JSON object merged into every request's body, e.g. "
                             "'{\"sampling_params_list\": [null, {\"max_tokens\": 200}]}'")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", type=Path, default=Path("."))
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--save-detailed", action="store_true",
                        help="with --save-result: each request's figures too (vLLM's ttfts, ... lists)")
    parser.add_argument("--no-plot", action="store_true", help="with --save-result: no PNG beside the JSON")
    parser.add_argument("--disable-tqdm", action="store_true")


def load_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset_name == "custom":
        if args.dataset_path is None:
            raise DatasetError("--dataset-name custom needs --dataset-path (a JSONL of {'prompt': ...} lines)")
        return custom_requests(args.dataset_path, args.num_prompts, args.random_output_len, args.seed)
    return random_requests(args.num_prompts, args.random_input_len, args.random_output_len, args.seed)


async def first_model(client: httpx.AsyncClient, settings: BenchSettings) -> str:
    response = await client.get(settings.api("/v1/models"), headers=settings.headers())
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Send every request (arrivals at ``--request-rate``, at most ``--max-concurrency`` at once)
    and return the run's figures with its settings."""
    requests = load_requests(args)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    backend = BACKENDS[args.backend]
    settings = BenchSettings(args.base_url, args.model or "", args.endpoint, args.api_key, args.voice,
                             args.temperature, args.ignore_eos, speech_format=args.speech_format,
                             extra_body=args.extra_body)
    limits = httpx.Limits(max_connections=args.max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(limits=limits, timeout=settings.timeout_s) as client:
        if not settings.model:
            settings.model = await first_model(client, settings)
        if args.backend in SPEECH_IN:
            await prepare_audio(client, settings, requests)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = progress_bar(len(requests), args.disable_tqdm)
        rng = random.Random(args.seed)

        async def one(request: BenchRequest) -> RequestResult:
            if gate is None:
                result = await backend(client, settings, request)
            else:
                async with gate:
                    result = await backend(client, settings, request)
            if bar is not None:
                bar.update(1)
            return result

        started = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.ensure_future(one(request)))
            if math.isfinite(args.request_rate) and args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        if bar is not None:
            bar.close()
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "model_id": settings.model,
            "base_url": args.base_url, "num_prompts": len(requests),
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "max_concurrency": args.max_concurrency, "dataset_name": args.dataset_name,
            **summarize(results, duration, percentiles), **per_request(results)}


def progress_bar(total: int, disabled: bool) -> Any:
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, file=sys.stderr)


def report(result: dict[str, Any]) -> str:
    """The figures as ``vllm bench serve`` prints them, audio's after."""
    lines = [f"{' Serving Benchmark Result ':=^60}"]
    for key in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "total_audio_s",
                "audio_throughput", "underruns", "underrun_ms", "streams_with_underruns"):
        if key in result:
            value = result[key]
            lines.append(f"{key:<45}{value:>15.2f}" if isinstance(value, float) else f"{key:<45}{value:>15}")
    for key, value in result.items():
        if key.startswith(("mean_", "median_", "std_", "p")) and isinstance(value, float):
            lines.append(f"{key:<45}{value:>15.2f}")
    return "\n".join(lines)


def result_path(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    name = args.result_filename or (f"{args.backend}-{result['request_rate']}qps-"
                                    f"{str(result['model_id']).replace('/', '_')}-{result['date']}.json")
    return args.result_dir / name


def save_plot(result: dict[str, Any], path: Path) -> None:
    try:
        from omni_engine.bench.plot import plot_result

        print(f"wrote {plot_result(result, path)}")
    except ImportError as exc:
        print(f"no plot ({exc}; pip install 'omni_engine[bench]')", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(run_benchmark(args))
    except DatasetError as exc:
        print(f"omni-engine bench serve: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"omni-engine bench serve: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 1
    print(report(result))
    if args.save_result:
        path = result_path(args, result)
        if not args.no_plot:
            save_plot(result, path.with_suffix(".png"))
        saved = result if args.save_detailed else {k: v for k, v in result.items() if k not in PER_REQUEST_KEYS}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(saved, indent=2))
        print(f"wrote {path}")
    return 0 if result["completed"] else 1
