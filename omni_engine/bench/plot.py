"""A picture of a run beside its JSON: where the latencies lie, not only their percentiles.

Drawn from the per-request lists (``results.per_request``) with matplotlib (the ``bench`` extra),
without a display. Panels: the distribution (CDF) of time to first token and, with audio, of time
to first audio; of end-to-end latency; and with audio, the silence each stream's listener heard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_result(result: dict[str, Any], path: Path) -> Path:
    """Write the run's PNG to ``path``; ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    audio = "ttfas" in result
    fig, axes = plt.subplots(1, 3 if audio else 2, figsize=(5.5 * (3 if audio else 2), 4.0), squeeze=False)
    first, e2e = axes[0][0], axes[0][1]
    _cdf(first, result.get("ttfts", []), "time to first token")
    if audio:
        _cdf(first, result.get("ttfas", []), "time to first audio")
    first.set_xlabel("ms from sending the request")
    _cdf(e2e, result.get("e2els", []), "end-to-end latency")
    e2e.set_xlabel("ms from sending the request")
    if audio:
        ax = axes[0][2]
        silences = [v for v in result.get("underrun_ms_per_stream", []) if v is not None]
        ax.bar(range(len(silences)), silences, color="tab:red")
        ax.set_title(f"underruns: {result.get('underruns', 0)} in {result.get('streams_with_underruns', 0)} "
                     f"of {len(silences)} streams")
        ax.set_xlabel("stream (request order)")
        ax.set_ylabel("silence heard mid-stream (ms)")
    concurrency = result.get("max_concurrency") or "all"
    fig.suptitle(f"{result.get('backend')} on {result.get('model_id')}: {result.get('completed')} requests, "
                 f"rate {result.get('request_rate')}/s, concurrency {concurrency}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cdf(ax: Any, values_s: list[float | None], label: str) -> None:
    values = sorted(1000.0 * v for v in values_s if v is not None)
    if not values:
        return
    fractions = [(i + 1) / len(values) for i in range(len(values))]
    ax.step(values, fractions, where="post", label=f"{label} (p50 {values[len(values) // 2]:.0f} ms)")
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("share of requests")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
