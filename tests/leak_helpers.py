"""What a test may leave behind in /dev/shm: the named semaphores of ``multiprocessing``."""

from __future__ import annotations

import time

from omni_engine.connectors.semaphores import SEMAPHORE_GLOB, SHM_DIR, orphan_semaphores


def semaphore_names() -> set[str]:
    return {p.name for p in SHM_DIR.glob(SEMAPHORE_GLOB)}


def leftover_semaphores(before: set[str], wait_s: float = 10.0) -> list[str]:
    """Semaphores made since ``before`` that no process maps any more, after waiting ``wait_s``
    for resource trackers to unlink them (a tracker does once every process it serves is gone)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = sorted(p.name for p in orphan_semaphores(min_age_s=0) if p.name not in before)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
