"""A transfer queue server as a real process (``omni-engine transfer-queue serve``) for tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from omni_engine.transfer_queue.server import READY_PREFIX

REPO = Path(__file__).resolve().parent.parent


class ServerProcess:
    """``omni-engine transfer-queue serve`` on free ports; ``url`` and ``rpc`` once it is ready."""

    def __init__(self, *args: str, data_dir: str | os.PathLike | None = None, timeout: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "omni_engine.entrypoints.cli.main", "transfer-queue", "serve",
               "--port", "0", "--rpc-address", "tcp://127.0.0.1:0", "--log-level", "WARNING", *args]
        if data_dir is not None:
            cmd += ["--data-dir", str(data_dir)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        ready = threading.Event()
        self.info: dict = {}

        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith(READY_PREFIX):
                    self.info = json.loads(line[len(READY_PREFIX):])
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or not self.info:
            self.kill()
            raise RuntimeError("transfer queue server did not start:\n" + "".join(self.lines))
        self.url: str = self.info["http"]
        self.rpc: str = self.info["rpc"]

    def kill(self) -> None:
        """``kill -9``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def output(self) -> str:
        time.sleep(0.05)
        return "".join(self.lines)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def trajectory(uid: str, instance_id: str, reward: float = 1.0, size: int = 0) -> dict:
    """A slime-shaped trajectory (``size``: pad the answer to about that many bytes)."""
    return {
        "uid": uid,
        "instance_id": instance_id,
        "messages": [{"role": "user", "content": f"Solve {instance_id}"},
                     {"role": "assistant", "content": "x = 2\n\\boxed{2}" + "." * size}],
        "reward": reward,
        "extra_info": {"timestamp": "1707900000.0", "finish_reason": "stop", "label": "2"},
    }
