"""``StageLauncher``: the Ray actor that runs one stage replica's process on its node.

Ray decides the node (a bundle of the stage's placement group); the stage
process itself is our ordinary one (``StageProcess``: exec, its own process
group, the parent-death signal, a log file), a child of this actor, so it
dies with the actor and the actor dies with the pipeline's client (its
owner). The stage's CURVE keypair is generated here, on the node where it is
used: only the public key goes back through Ray; the secret goes to the
stage through its spawn pipe, as on one host.

Runs in a Ray worker process, so everything it returns is plain data.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import msgspec

from omni_engine.connectors.shm import unlink_prefix
from omni_engine.stage_engine.security import KeyPair, StageCurveKeys
from omni_engine.stage_engine.stage_process import StageProcess, default_log_dir
from omni_engine.stage_engine.stage_sockets import remove_stale_runtime_dirs
from omni_engine.stage_engine.stage_spec import StageProcessSpec

# The socket directory of a launched stage (vLLM's own sockets): <prefix><launcher pid>-<random>.
LAUNCHER_DIR_PREFIX = "omni-ray-"


class LaunchedStage(msgspec.Struct, frozen=True):
    """What the client learns of a stage process its launcher started."""

    pid: int
    node_id: str
    node_ip: str
    log_path: str


class StageLauncher:
    """One stage replica's process on this node (methods run concurrently: ``max_concurrency``)."""

    def __init__(self) -> None:
        import ray

        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self._keypair: KeyPair | None = None
        self._process: StageProcess | None = None
        self._runtime_dir: Path | None = None
        self._lock = threading.Lock()

    def make_keypair(self) -> bytes:
        """A fresh CURVE keypair for the stage; only its public key leaves this node."""
        self._keypair = KeyPair.generate()
        return self._keypair.public

    def start(self, spec: StageProcessSpec, server_public: bytes | None, client_host_id: str) -> LaunchedStage:
        """Start the stage process. It talks to the client with frames only when the client is on
        another node, and uses the keypair made here (``server_public`` None: no CURVE)."""
        if "OMP_NUM_THREADS" not in spec.env:
            # Ray sets OMP_NUM_THREADS in its workers; a stage that reserved no CPU gets what a local
            # stage would get: no setting. (With CPUs reserved the client put their count in spec.env.)
            os.environ.pop("OMP_NUM_THREADS", None)
        # A launcher killed with its node never cleaned up after its stage: the next one here does.
        remove_stale_runtime_dirs(LAUNCHER_DIR_PREFIX, "*-*")
        self._runtime_dir = Path(tempfile.mkdtemp(prefix=f"{LAUNCHER_DIR_PREFIX}{os.getpid()}-"))
        changes = dict(host_id=self.node_id, env={"VLLM_RPC_BASE_PATH": str(self._runtime_dir), **spec.env})
        if server_public is not None:
            changes["curve"] = StageCurveKeys(self._keypair, server_public)
        if client_host_id != self.node_id:
            changes["connectors"] = msgspec.structs.replace(spec.connectors, use_shm=False)
        spec = spec.replace(**changes)
        log_path = default_log_dir() / f"{spec.transport.shm_prefix}.log"
        with self._lock:
            self._process = StageProcess(spec.stage_id, spec, log_path)
            self._process.start()
        return LaunchedStage(self._process.pid, self.node_id, self.node_ip, str(log_path))

    def wait_exit(self) -> int | None:
        """Block until the stage process exits; its exit code. Its segments and socket files go with it."""
        process = self._process
        process.join(None)
        self._clean_up()
        return process.exitcode

    def stop(self, graceful_timeout: float, term_timeout: float) -> int | None:
        """``StageProcess.stop`` here: grace for a requested exit, then SIGTERM, then SIGKILL of its group.
        The log of a stage that exited cleanly goes."""
        process = self._process
        process.stop(graceful_timeout, term_timeout)
        if process.exitcode == 0:
            process.discard_log()
        self._clean_up()
        return process.exitcode

    def kill_group(self) -> None:
        self._process.kill_group()
        self._clean_up()

    def log_tail(self, max_lines: int) -> str:
        return self._process.log_tail(max_lines) if self._process is not None else ""

    def _clean_up(self) -> None:
        with self._lock:
            if self._process is not None:
                unlink_prefix(self._process.spec.transport.shm_prefix)
            if self._runtime_dir is not None:
                shutil.rmtree(self._runtime_dir, ignore_errors=True)
