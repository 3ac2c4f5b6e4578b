"""A run's figures: ``vllm bench serve``'s keys and meanings for text, and audio's own beside them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from omni_engine.bench.backends import RequestResult
from omni_engine.bench.playback import play


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float], scale: float = 1000.0,
           suffix: str = "_ms") -> dict[str, float]:
    """``mean_/median_/std_/p<N>_<name><suffix>`` as vLLM names them (0 when there are no values)."""
    values = np.asarray(values_s, dtype=np.float64) * scale
    empty = values.size == 0
    out = {f"mean_{name}{suffix}": 0.0 if empty else float(values.mean()),
           f"median_{name}{suffix}": 0.0 if empty else float(np.median(values)),
           f"std_{name}{suffix}": 0.0 if empty else float(values.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}{suffix}"] = 0.0 if empty else float(np.percentile(values, p))
    return out


def summarize(results: Sequence[RequestResult], duration_s: float, percentiles: Sequence[float]) -> dict[str, Any]:
    """The run's figures. Text as vLLM computes them: TPOT per request is (latency - TTFT) over its
    output tokens after the first; ITL every gap between content chunks. Audio: time to first
    audio, real-time factor (latency over audio seconds: under 1 is faster than real time), audio
    seconds per second of the run, and the underruns of a listener at 1x (``playback.play``)."""
    done = [r for r in results if r.success]
    out_tokens = [r.output_tokens for r in done]
    in_tokens = [r.prompt_tokens or r.prompt_words for r in done]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1 and r.ttft]
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": int(sum(in_tokens)),
        "total_output_tokens": int(sum(out_tokens)),
        "request_throughput": len(done) / duration_s,
        "output_throughput": sum(out_tokens) / duration_s,
        "total_token_throughput": (sum(in_tokens) + sum(out_tokens)) / duration_s,
        **_stats("ttft", [r.ttft for r in done if r.text], percentiles),
        **_stats("tpot", tpots, percentiles),
        **_stats("itl", [gap for r in done for gap in r.itl], percentiles),
        **_stats("e2el", [r.latency for r in done], percentiles),
        "errors": [r.error for r in results if not r.success][:20],
    }
    heard = [(r, play(r.audio_chunks)) for r in done if r.audio_chunks]
    if heard:
        audio_s = sum(p.audio_s for _, p in heard)
        summary.update({
            "total_audio_s": audio_s,
            "audio_throughput": audio_s / duration_s,
            **_stats("ttfa", [p.first_audio_s for _, p in heard], percentiles),
            **_stats("rtf", [r.latency / p.audio_s for r, p in heard], percentiles, scale=1.0, suffix=""),
            "underruns": sum(p.underruns for _, p in heard),
            "underrun_ms": 1000.0 * sum(p.underrun_s for _, p in heard),
            "streams_with_underruns": sum(p.underruns > 0 for _, p in heard),
        })
    return summary


# The per-request lists ``per_request`` adds (vLLM's ``--save-detailed`` keys, and audio's own).
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "e2els", "ttfas", "underrun_ms_per_stream")


def per_request(results: Sequence[RequestResult]) -> dict[str, list[Any]]:
    """Each request's figures, in request order (seconds, as vLLM's detailed result has its ``ttfts``);
    audio lists only where audio came (None for a request without)."""
    detail: dict[str, list[Any]] = {
        "input_lens": [r.prompt_tokens or r.prompt_words for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft if r.success and r.text else None for r in results],
        "e2els": [r.latency if r.success else None for r in results],
    }
    if any(r.audio_chunks for r in results):
        heard = [play(r.audio_chunks) if r.success and r.audio_chunks else None for r in results]
        detail["ttfas"] = [p.first_audio_s if p else None for p in heard]
        detail["underrun_ms_per_stream"] = [1000.0 * p.underrun_s if p else None for p in heard]
    return detail
