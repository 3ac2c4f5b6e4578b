"""Launching and reaping a stage process (spawn), with its log and sentinel."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any, BinaryIO

from omni_engine import envs
from omni_engine.connectors.shm import is_stage_prefix, unlink_prefix
from omni_engine.stage_engine.stage_entry import ZMQ_STAGE_MAIN, run_stage_process
from omni_engine.stage_engine.stage_spec import StageProcessSpec
from omni_engine.utils import describe_exit, tail_file

logger = logging.getLogger(__name__)


def default_log_dir() -> Path:
    return envs.log_dir()


# The stage process's first code: the client's sys.path before anything of ours
# is imported (so the child runs the client's omni_engine, installed or not).
_BOOTSTRAP = ("import os, pickle, sys; pipe = os.fdopen(int(sys.argv[1]), 'rb'); sys.path[:] = pickle.load(pipe); "
              "from omni_engine.stage_engine.stage_entry import main; main(pipe)")


class _ExecLaunch:
    """A stage process started by exec, its spec sent through a pipe.

    Its environment (the device-control variable above all) is in place from
    its first instruction, as ``/proc/<pid>/environ`` shows, and nothing of the
    client's ``__main__`` is re-imported in it (no ``if __name__`` guard needed).
    The sentinel is a pidfd: readable the moment the process exits.
    """

    def __init__(self, spec: StageProcessSpec, main: str) -> None:
        self.spec, self.main = spec, main
        self.popen: subprocess.Popen | None = None
        self.sentinel = -1
        # A warm spare's pipe stays open: the spec it is to serve comes through it when it is taken,
        # and its closing (ours, or this process's end) tells the spare it is not wanted.
        self.pipe: BinaryIO | None = None

    def start(self) -> None:
        read_end, write_end = os.pipe()
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(read_end)],
                pass_fds=(read_end,), env=self.spec.exec_environment(os.environ),
                stdin=subprocess.DEVNULL, process_group=0)
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self.sentinel = os.pidfd_open(self.popen.pid)
        weakref.finalize(self, os.close, self.sentinel)
        pipe = os.fdopen(write_end, "wb")
        try:
            pickle.dump(sys.path, pipe)
            pickle.dump((self.spec, self.main), pipe)
            if self.spec.spare:
                pipe.flush()
                self.pipe, pipe = pipe, None
                weakref.finalize(self, self.pipe.close)
        except BrokenPipeError:
            pass  # it died at once; its sentinel and exit code say how
        finally:
            if pipe is not None:
                close_quietly(pipe)

    def take(self, spec: StageProcessSpec) -> None:
        """Hand a warm spare the spec it serves from now on (once)."""
        if self.pipe is None:
            raise RuntimeError(f"stage {self.spec.stage_id}: process {self.pid} is not a warm spare waiting to be "
                               "taken")
        pipe, self.pipe = self.pipe, None
        try:
            pickle.dump(spec, pipe)
        except BrokenPipeError:
            pass  # it died waiting; its sentinel and exit code say how
        finally:
            close_quietly(pipe)

    def release(self) -> None:
        """A spare not taken: closing its pipe tells it to exit."""
        if self.pipe is not None:
            pipe, self.pipe = self.pipe, None
            close_quietly(pipe)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def join(self, timeout: float | None) -> None:
        if self.popen is not None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass

    def kill(self) -> None:
        self.release()
        if self.popen is not None:
            self.popen.kill()


def close_quietly(pipe: BinaryIO) -> None:
    try:
        pipe.close()
    except BrokenPipeError:
        pass  # the reader is gone: what was buffered has nowhere to go


class _SpawnLaunch:
    """A stage process started by ``multiprocessing`` (spawn): what can hand it the
    legacy architecture's queues. It applies its environment first thing, before
    vLLM is imported, but after the client's ``__main__`` was re-imported in it."""

    def __init__(self, spec: StageProcessSpec, main: str, channels: dict[str, Any]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(
            target=run_stage_process, name=f"omni-stage-{spec.stage_id}",
            daemon=False,  # vLLM starts children; tied to us by PDEATHSIG instead
            kwargs=dict(spec=spec, main=main, **channels))

    def start(self) -> None:
        self.proc.start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    @property
    def sentinel(self) -> int:
        return self.proc.sentinel

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def join(self, timeout: float | None) -> None:
        self.proc.join(timeout)

    def kill(self) -> None:
        try:
            self.proc.kill()
        except (ProcessLookupError, ValueError):
            pass


class StageProcess:
    """One stage process and its process group (vLLM's children included)."""

    def __init__(
        self,
        stage_id: int,
        spec: StageProcessSpec,
        log_path: Path | None = None,
        *,
        main: str = ZMQ_STAGE_MAIN,
        channels: dict[str, Any] | None = None,
    ) -> None:
        """Start ``spec`` (its launch fields filled in here) running ``main``, the
        dotted path of the stage's serving function; ``channels`` are extra
        arguments for it that cannot be part of a spec (the legacy queues, which
        only ``multiprocessing`` can hand over)."""
        transport = spec.transport
        if transport is not None and not is_stage_prefix(transport.shm_prefix):
            # The client ignores a READY whose prefix is not of this shape (it
            # decides what is unlinked when the stage dies), so fail here, loudly.
            raise ValueError(f"stage {stage_id}: shm_prefix {transport.shm_prefix!r} is not a stage prefix "
                             f"(make one with connectors.shm.stage_prefix(new_run_prefix(), {stage_id}))")
        self.stage_id = stage_id
        self.log_path = log_path or default_log_dir() / f"stage{stage_id}-{os.getpid()}.log"
        self.spec = spec.replace(stage_id=stage_id, log_path=str(self.log_path), parent_pid=os.getpid())
        self._launch = (_SpawnLaunch(self.spec, main, channels) if channels
                        else _ExecLaunch(self.spec, main))

    def start(self) -> None:
        self._launch.start()

    @property
    def waiting_spare(self) -> bool:
        """A warm spare, alive and not taken yet."""
        return isinstance(self._launch, _ExecLaunch) and self._launch.pipe is not None and self.is_alive()

    def take(self, spec: StageProcessSpec) -> None:
        """Make a warm spare serve ``spec`` (this process's launch fields kept: log, parent)."""
        assert isinstance(self._launch, _ExecLaunch)
        self.spec = spec.replace(stage_id=self.stage_id, log_path=str(self.log_path), parent_pid=os.getpid(),
                                 spare=False)
        self._launch.take(self.spec)

    @property
    def pid(self) -> int | None:
        return self._launch.pid

    @property
    def sentinel(self) -> int:
        return self._launch.sentinel

    @property
    def exitcode(self) -> int | None:
        return self._launch.exitcode

    def is_alive(self) -> bool:
        return self.pid is not None and self.exitcode is None

    def describe_exit(self) -> str:
        return f"stage {self.stage_id} process (pid {self.pid}) {describe_exit(self.exitcode)}"

    def log_tail(self, max_lines: int = 30) -> str:
        return tail_file(self.log_path, max_lines)

    def discard_log(self) -> None:
        """Remove the log (of a stage that exited cleanly: nothing in it to keep)."""
        self.log_path.unlink(missing_ok=True)

    def join(self, timeout: float | None = None) -> None:
        self._launch.join(timeout)

    def kill_group(self) -> None:
        """SIGKILL the stage and everything it started (its process group)."""
        pid = self.pid
        if pid is None:
            return
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.exitcode is None:
            self._launch.kill()
        self.join(5)

    def stop(self, graceful_timeout: float = 0.0, term_timeout: float = 5.0) -> None:
        """Wait ``graceful_timeout`` for a requested exit, then SIGTERM, then SIGKILL the group."""
        if self.pid is None:
            return
        if isinstance(self._launch, _ExecLaunch):
            self._launch.release()  # a spare exits at once
        if graceful_timeout > 0:
            self.join(graceful_timeout)
        if self.exitcode is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self.join(term_timeout)
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


__all__ = ["StageProcess", "StageProcessSpec", "cleanup_stage", "default_log_dir"]
