"""Launching and reaping a stage process (spawn), with its log and sentinel."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_engine.connectors.shm import is_stage_prefix, unlink_prefix
from omni_engine.stage_engine.security import StageCurveKeys
from omni_engine.stage_engine.stage_core_proc import run_stage_worker
from omni_engine.utils import describe_exit, tail_file

logger = logging.getLogger(__name__)


@dataclass
class StageProcessSpec:
    """What a stage process runs: everything the spawned child needs to build its engine."""

    stage_type: str
    engine_args: dict[str, Any]
    runtime: dict[str, Any] = field(default_factory=dict)
    final_output_type: str | None = None
    # Extra environment for the stage (e.g. VLLM_CPU_KVCACHE_SPACE).
    env: dict[str, str] = field(default_factory=dict)
    log_level: str = "INFO"
    # CURVE keys the stage connects with; by default the client's pipeline
    # keys. Sent through the spawn pipe, never argv or the environment.
    curve: StageCurveKeys | None = field(default=None, repr=False)


def default_log_dir() -> Path:
    path = Path(os.environ.get("OMNI_ENGINE_LOG_DIR", Path(tempfile.gettempdir()) / "omni_engine_logs"))
    path.mkdir(parents=True, exist_ok=True)
    return path


class StageProcess:
    """One spawned stage process and its process group (vLLM's children included)."""

    def __init__(
        self,
        stage_id: int,
        spec: StageProcessSpec,
        input_address: str | None = None,
        output_address: str | None = None,
        shm_prefix: str | None = None,
        log_path: Path | None = None,
        *,
        target: Callable[..., None] = run_stage_worker,
        channels: dict[str, Any] | None = None,
    ) -> None:
        """``target`` is the process's entry point; ``channels`` what it talks
        over (default: the ZMQ addresses of ``run_stage_worker``)."""
        if shm_prefix is not None and not is_stage_prefix(shm_prefix):
            # The client ignores a READY whose prefix is not of this shape (it
            # decides what is unlinked when the stage dies), so fail here, loudly.
            raise ValueError(f"stage {stage_id}: shm_prefix {shm_prefix!r} is not a stage prefix "
                             f"(make one with connectors.shm.stage_prefix(new_run_prefix(), {stage_id}))")
        self.stage_id = stage_id
        self.log_path = log_path or default_log_dir() / f"stage{stage_id}-{os.getpid()}.log"
        if channels is None:
            channels = dict(input_address=input_address, output_address=output_address, shm_prefix=shm_prefix,
                            curve=spec.curve)
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=target,
            name=f"omni-stage-{stage_id}",
            daemon=False,  # vLLM starts children; tied to us by PDEATHSIG instead
            kwargs=dict(
                stage_id=stage_id,
                stage_type=spec.stage_type,
                engine_args=spec.engine_args,
                runtime=spec.runtime,
                final_output_type=spec.final_output_type,
                parent_pid=os.getpid(),
                log_level=spec.log_level,
                log_path=str(self.log_path),
                env=spec.env,
                **channels,
            ),
        )

    def start(self) -> None:
        self._proc.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def sentinel(self) -> int:
        return self._proc.sentinel

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def describe_exit(self) -> str:
        return f"stage {self.stage_id} process (pid {self.pid}) {describe_exit(self.exitcode)}"

    def log_tail(self, max_lines: int = 30) -> str:
        return tail_file(self.log_path, max_lines)

    def join(self, timeout: float | None = None) -> None:
        self._proc.join(timeout)

    def kill_group(self) -> None:
        """SIGKILL the stage and everything it started (its process group)."""
        pid = self._proc.pid
        if pid is None:
            return
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._proc.exitcode is None:
            try:
                self._proc.kill()
            except (ProcessLookupError, ValueError):
                pass
        self._proc.join(5)

    def stop(self, graceful_timeout: float = 0.0, term_timeout: float = 5.0) -> None:
        """Wait ``graceful_timeout`` for a requested exit, then SIGTERM, then SIGKILL the group."""
        if self._proc.pid is None:
            return
        if graceful_timeout > 0:
            self._proc.join(graceful_timeout)
        if self._proc.exitcode is None:
            try:
                os.kill(self._proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self._proc.join(term_timeout)
        self.kill_group()


def cleanup_stage(process: StageProcess | None, runtime_dir: Path, shm_prefix: str, ctx: Any) -> None:
    """Last-resort cleanup of a stage connection (shutdown, GC or interpreter exit):
    its process group, socket directory, shared memory and ZMQ context."""
    if process is not None:
        process.kill_group()
    shutil.rmtree(runtime_dir, ignore_errors=True)
    unlink_prefix(shm_prefix)
    if ctx is not None:
        ctx.destroy(linger=0)
