"""The run's progress on a terminal (a tqdm bar) and its summary at the end."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from omni_engine.sampling.pipeline import RunSummary

# Redrawing the bar for every result would cost more than the results at high rates.
_MIN_INTERVAL_S = 0.5


class TerminalProgress:
    """Items done / total, accepted rollouts and generated tokens/s; silent when not a terminal."""

    def __init__(self, stream: TextIO = sys.stderr, enabled: bool | None = None) -> None:
        self.stream = stream
        self.enabled = stream.isatty() if enabled is None else enabled
        self._bar: Any = None
        self._started = time.monotonic()
        self._last = 0.0

    def start(self, total_items: int, done_items: int) -> None:
        self._started = time.monotonic()
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total_items, initial=done_items, unit="item", file=self.stream,
                             dynamic_ncols=True, desc="sampling")

    def update(self, summary: RunSummary, items_done: int, accepted: int) -> None:
        now = time.monotonic()
        if self._bar is None or now - self._last < _MIN_INTERVAL_S:
            return
        self._last = now
        self._bar.n = items_done
        rate = summary.completion_tokens / max(now - self._started, 1e-9)
        self._bar.set_postfix(accepted=accepted, requests=summary.requests, tok_s=f"{rate:.0f}", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def format_summary(summary: RunSummary, output_dir: str) -> str:
    s = summary
    return (f"{s.items} items in {s.shards + s.shards_skipped} shards ({s.shards_skipped} already done) -> "
            f"{output_dir}\n"
            f"{s.requests} requests ({s.failed_requests} failed; {s.requests_replayed} replayed from journals), "
            f"{s.responses} responses: {s.rollouts} rollouts kept, {s.truncated} truncated, {s.correct} scored > 0\n"
            f"{s.completion_tokens} tokens in {s.seconds:.1f} s ({s.tokens_per_s:.1f} tokens/s)"
            + (f"\n{s.published} trajectories written to the transfer queue ({s.already_published} it had "
               "already)" if s.published or s.already_published else ""))
