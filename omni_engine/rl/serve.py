"""A rollout server for a learner that was given none: ``omni-engine serve`` with the RL routes on."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

START_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def rollout_server(pipeline_config: str | Path, model_name: str, log_path: str | Path,
                   cpus: set[int] | None = None, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start ``omni-engine serve`` on a free local port (``VLLM_SERVER_DEV_MODE=1``: the weight-sync
    routes on); yields its URL once healthy; stops it (its whole process group) on exit. ``cpus``
    confines it (and its stages) to those cores, ``env`` adds to its environment."""
    port = _free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
    # torchrun's rank variables would make the server's vLLM think it is one rank of a job.
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "omni_engine.entrypoints.cli.main", "serve", str(pipeline_config),
             "--port", str(port), "--served-model-name", model_name],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"the rollout server exited with {proc.returncode} while starting; "
                                   f"its log: {log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the rollout server was not healthy after {START_TIMEOUT_S:.0f} s; "
                                   f"its log: {log_path}")
            time.sleep(0.5)  # start-up only: nothing to wait on but the port
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
