#!/usr/bin/env python
"""Qwen3-Omni-MoE served (thinker -> talker -> code2wav): async_chunk against sequential, chats and
realtime sessions.

    python benchmarks/bench_qwen3_omni.py [--concurrency 1,4,8] [--sessions 1,4] [--thinker-tokens 16]
                                          [--talker-frames 60]

Two ``omni-engine serve`` runs of the tiny seeded checkpoint (``prepare-model qwen3-omni-tiny``),
one after the other in this one run: the family's config (``async_chunk``: code2wav decodes the
first 4 frames as soon as the talker has made them, then pieces ramped up to 25) and
``stage_configs/qwen3_omni_moe_sequential.yaml`` (code2wav decodes all the frames at the end),
driven by ``omni-engine bench serve --backend openai-chat-audio`` (streamed chat with ``modalities:
[text, audio]``, each stream played by a listener at 1x). Each chat does the same work: exactly
``--thinker-tokens`` thinker tokens and ``--talker-frames`` talker frames (min = max tokens,
greedy). Then, on the async_chunk server, ``--backend openai-realtime``: sessions that speak a
question (Piper, at the pace of speech), the server's VAD ends the turn, the thinker hears it and the
answer comes back in speech (the talker's defaults set by a deploy file to the chats' greedy
``--talker-frames``, as a session cannot set them). The issue's targets, as ratios of this run:
first audio at concurrency 1 with async_chunk <= 0.4x the sequential config's; first audio p95 at
concurrency 4 <= 1.5x its p50 at 1; 8 streams at once: none underruns after its first audio;
realtime, 4 sessions at once: first audio p95 <= 2x a lone session's (p50). Writes
``benchmarks/results/bench_qwen3_omni.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import RESULTS, machine_info, progress, stop_process_groups, write_json  # noqa: E402
from benchmarks.bench_qwen_omni import QUESTIONS, SERVED, bench, start_server  # noqa: E402
from benchmarks.bench_startup import free_port, wait_healthy  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KEYS = ("completed", "failed", "request_throughput", "median_ttft_ms", "median_ttfa_ms", "p95_ttfa_ms",
        "median_rtf", "median_e2el_ms", "underruns", "streams_with_underruns", "underrun_ms", "errors")
TARGETS = {"first_audio_at_1_async_over_sequential": 0.4, "p95_first_audio_at_4_over_p50_at_1": 1.5,
           "streams_with_underruns_at_8": 0, "realtime_p95_first_audio_at_4_over_lone_p50": 2.0}


def spoken_questions(folder: Path) -> Path:
    """A dataset of the questions spoken by Piper as the realtime tests speak them (``piper-joe``, its
    noise off: the same audio every run), as WAV files, for the realtime sessions."""
    from omni_engine.audio import wav_bytes
    from tests.realtime_helpers import spoken

    rows = []
    for i, question in enumerate(QUESTIONS):
        (folder / f"q{i}.wav").write_bytes(wav_bytes(spoken(question) / 32768.0, 24000))
        rows.append(json.dumps({"audio": f"q{i}.wav"}) + "\n")
    path = folder / "spoken.jsonl"
    path.write_text("".join(rows))
    return path


# --codec-plan: how the talker -> code2wav edge cuts its pieces (custom_process_input_args)
CODEC_PLANS = {"paced": {"codec_chunk_ramp": True, "codec_chunk_pacing": True},  # the family's default
               "ramped": {"codec_chunk_ramp": True, "codec_chunk_pacing": False},
               "vllm-omni": {"codec_chunk_ramp": False, "codec_chunk_pacing": False}}


def talker_deploy(folder: Path, talker_tokens: int, codec_plan: str = "paced") -> Path:
    """A deploy file (vLLM-Omni's shape) whose talker defaults are the chats' talker: greedy, exactly
    ``talker_tokens`` (a realtime session takes the stages' defaults), and whose connector into
    code2wav sets the codec plan (``CODEC_PLANS``)."""
    plan = ", ".join(f"{k}: {str(v).lower()}" for k, v in CODEC_PLANS[codec_plan].items())
    path = folder / "talker_deploy.yaml"
    path.write_text(f"connectors:\n  plan:\n    name: SharedMemoryConnector\n    extra: {{{plan}}}\n"
                    "stages:\n  - stage_id: 1\n    default_sampling_params: "
                    f"{{temperature: 0.0, max_tokens: {talker_tokens}, min_tokens: {talker_tokens}}}\n"
                    "  - stage_id: 2\n    input_connectors: {from_stage_1: plan}\n")
    return path


def bench_realtime(base_url: str, sessions: int, prompts: int, dataset: Path, thinker_tokens: int) -> dict[str, Any]:
    from omni_engine.bench.serve_bench import add_arguments, run_benchmark

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--base-url", base_url, "--backend", "openai-realtime", "--model", SERVED, "--dataset-name", "custom",
        "--dataset-path", str(dataset), "--num-prompts", str(prompts), "--max-concurrency", str(sessions),
        "--random-output-len", str(thinker_tokens), "--metric-percentiles", "50,95", "--disable-tqdm"])
    return asyncio.run(run_benchmark(args))


def serve_and_bench(target: str, name: str, levels: list[int], prompts: int, dataset: Path, thinker_tokens: int,
                    talker_tokens: int, deploy: Path, spoken: Path | None = None,
                    sessions: list[int] = ()) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """The chats' figures per concurrency, and (``spoken``) the realtime sessions' per sessions at once."""
    log = RESULTS / f"bench_qwen3_omni_{name}_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = start_server(Path(target), port, log, ("--deploy-config", str(deploy)))
    served: dict[int, dict[str, Any]] = {}
    realtime: dict[int, dict[str, Any]] = {}
    try:
        wait_healthy(proc, port, log)
        url = f"http://127.0.0.1:{port}"
        for n in levels:
            # Warm-up: one round at this concurrency (a batch size the stages have not run yet pays
            # one-time costs; measured here: the first 4 at once ~50 ms slower than the rounds after).
            bench(url, n, n, dataset, thinker_tokens, talker_tokens)
            result = bench(url, n, max(prompts, n), dataset, thinker_tokens, talker_tokens)
            served[n] = {k: result.get(k) for k in KEYS}
            progress(f"{name}, concurrency {n}: {served[n]}")
        if spoken is not None:
            for n in sessions:
                bench_realtime(url, n, n, spoken, thinker_tokens)  # warm-up (the VAD, the audio encoder)
                result = bench_realtime(url, n, max(prompts, n), spoken, thinker_tokens)
                realtime[n] = {k: result.get(k) for k in KEYS}
                progress(f"{name}, realtime sessions {n}: {realtime[n]}")
    finally:
        stop_process_groups([proc])
    return served, realtime


def ratios_of(chunked: dict[int, Any], whole: dict[int, Any], realtime: dict[int, Any]) -> dict[str, float | None]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {
        "first_audio_at_1_async_over_sequential": ratio(chunked.get(1, {}).get("median_ttfa_ms"),
                                                        whole.get(1, {}).get("median_ttfa_ms")),
        "p95_first_audio_at_4_over_p50_at_1": ratio(chunked.get(4, {}).get("p95_ttfa_ms"),
                                                    chunked.get(1, {}).get("median_ttfa_ms")),
        "streams_with_underruns_at_8": chunked.get(8, {}).get("streams_with_underruns"),
        "realtime_p95_first_audio_at_4_over_lone_p50": ratio(realtime.get(4, {}).get("p95_ttfa_ms"),
                                                             realtime.get(1, {}).get("median_ttfa_ms")),
    }


def report(runs: dict[str, dict[int, Any]], ratios: dict[str, float | None]) -> None:
    print(f"\n{'':>30} | {'req/s':>6} | {'TTFT p50':>9} | {'TTFA p50':>9} | {'TTFA p95':>9} | {'RTF p50':>7} | "
          f"underruns (streams)")
    for name, served in runs.items():
        for n, r in served.items():
            print(f"{name + ' ' + str(n):>30} | {r['request_throughput']:6.2f} | "
                  f"{r['median_ttft_ms'] or 0:7.0f} ms | {r['median_ttfa_ms'] or 0:7.0f} ms | "
                  f"{r['p95_ttfa_ms'] or 0:7.0f} ms | {r['median_rtf'] or 0:7.2f} | "
                  f"{r.get('underruns')} ({r.get('streams_with_underruns')})")
    for name, value in ratios.items():
        met = value is not None and value <= TARGETS[name]
        print(f"{name}: {value if value is None else round(value, 2)} (target <= {TARGETS[name]}: "
              f"{'met' if met else 'NOT met'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,8", help="chats at once, async_chunk")
    parser.add_argument("--sequential-concurrency", default="1", help="chats at once, sequential")
    parser.add_argument("--sessions", default="1,4", help="realtime sessions at once (empty: none)")
    parser.add_argument("--prompts-per-level", type=int, default=8, help="requests at each concurrency")
    parser.add_argument("--thinker-tokens", type=int, default=16)
    parser.add_argument("--talker-frames", type=int, default=60)
    parser.add_argument("--codec-plan", choices=sorted(CODEC_PLANS), default="paced",
                        help="the talker -> code2wav pieces: ramped and paced by the listener (the family's "
                             "default), ramped only, or vLLM-Omni's 4-then-25")
    parser.add_argument("--json", default=str(RESULTS / "bench_qwen3_omni.json"))
    args = parser.parse_args()
    from omni_engine.models.prepare import prepare_model

    def levels(text: str) -> list[int]:
        return [int(n) for n in text.split(",") if n]

    model_dir = prepare_model("qwen3-omni-tiny")
    work = Path(tempfile.mkdtemp(prefix="bench_qwen3_omni_"))
    dataset = work / "questions.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS))
    talker_tokens = args.talker_frames + 1  # a frame is completed at the step after its first code
    deploy = talker_deploy(work, talker_tokens, args.codec_plan)
    sessions = levels(args.sessions)
    chunked, realtime = serve_and_bench(str(model_dir), "async_chunk", levels(args.concurrency),
                                        args.prompts_per_level, dataset, args.thinker_tokens, talker_tokens, deploy,
                                        spoken_questions(work) if sessions else None, sessions)
    whole, _ = serve_and_bench(str(REPO / "stage_configs" / "qwen3_omni_moe_sequential.yaml"), "sequential",
                               levels(args.sequential_concurrency), args.prompts_per_level, dataset,
                               args.thinker_tokens, talker_tokens, deploy)
    runs = {"async_chunk": chunked, "sequential": whole, "async_chunk realtime": realtime}
    ratios = ratios_of(chunked, whole, realtime)
    report(runs, ratios)
    write_json(args.json, {"machine": machine_info(), "codec_plan": args.codec_plan, "thinker_tokens": args.thinker_tokens,
                           "talker_frames": args.talker_frames, "audio_s_per_request": args.talker_frames * 0.08,
                           "runs": runs, "ratios": ratios})


if __name__ == "__main__":
    main()
