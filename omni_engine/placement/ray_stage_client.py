"""``RayStageClient``: a stage replica whose process Ray placed, reached over tcp with CURVE.

Everything but the launch is ``StageEngineCoreClient``'s: the client binds
its sockets on an address the stage's node can reach (this node's Ray
address, never ``0.0.0.0``), a ``StageLauncher`` actor in the replica's
bundle starts the stage process there, and the stage connects back. The
stage's keypair is made on its node; only its public key comes here, and
only that key is admitted. A stage on another node says so in its READY
(its Ray node id), so tensors travel as ZMQ frames both ways. It sends a
heartbeat whenever it has been quiet for a quarter second; 1.5 s of silence
is its loss, or its node's, even when nothing else would tell (a
partitioned or frozen node): found within 1.65 s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any

from omni_engine.errors import StageStartupError
from omni_engine.placement.ray_placement import RayPlacement, RayStageGroup
from omni_engine.placement.stage_launcher import LaunchedStage
from omni_engine.stage_engine.security import CurveKeys
from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
from omni_engine.stage_engine.stage_spec import StageProcessSpec, StageTransport
from omni_engine.utils import describe_exit

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_TIMEOUT_S = 1.5
# How long a blocking control call to a launcher may take before it is given up.
_CALL_TIMEOUT_S = 5.0


class _ExitPipe:
    """A pipe whose read end turns readable when the remote process ends: a sentinel the event
    loop can watch like a local process's, fired from Ray's callback thread."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        self._lock = threading.Lock()
        self._open = True

    def fire(self, _: Any = None) -> None:
        with self._lock:
            if self._open:
                os.write(self._write_fd, b"x")

    def close(self) -> None:
        with self._lock:
            if self._open:
                self._open = False
                os.close(self.read_fd)
                os.close(self._write_fd)


class RemoteStageProcess:
    """A stage process a launcher actor runs on its node, with what the client asks of a local
    ``StageProcess``: sentinel, exit code, log tail, stop and kill, answered through Ray."""

    def __init__(self, stage_id: int, ray: Any, launcher: Any, launched: LaunchedStage) -> None:
        self.stage_id = stage_id
        self._ray = ray
        self.launcher = launcher
        self.pid: int | None = launched.pid
        self.node_id = launched.node_id
        self.node_ip = launched.node_ip
        self.log_path = Path(launched.log_path)  # on the stage's node
        self._pipe = _ExitPipe()
        weakref.finalize(self, self._pipe.close)
        # Resolves with the exit code when the process ends, or fails when the launcher (its node) is lost.
        self._exit: concurrent.futures.Future = launcher.wait_exit.remote().future()
        self._exit.add_done_callback(self._pipe.fire)

    @property
    def sentinel(self) -> int:
        return self._pipe.read_fd

    @property
    def exitcode(self) -> int | None:
        if not self._exit.done() or self._exit.exception() is not None:
            return None
        return self._exit.result()

    def is_alive(self) -> bool:
        return not self._exit.done()

    def describe_exit(self) -> str:
        where = f"stage {self.stage_id} process (pid {self.pid} on Ray node {self.node_id[:12]} at {self.node_ip})"
        if not self._exit.done():
            return f"{where} is still running"
        error = self._exit.exception()
        if error is not None:
            return f"{where} was lost with its launcher, its node may be gone ({type(error).__name__})"
        return f"{where} {describe_exit(self._exit.result())}"

    def log_tail(self, max_lines: int = 30) -> str:
        try:
            return self._ray.get(self.launcher.log_tail.remote(max_lines), timeout=_CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - its node may be gone, and its log with it
            return ""

    def discard_log(self) -> None:
        pass  # the launcher removed it when the stage stopped cleanly

    def join(self, timeout: float | None = None) -> None:
        concurrent.futures.wait([self._exit], timeout)

    def stop(self, graceful_timeout: float = 0.0, term_timeout: float = 5.0) -> None:
        """Blocking: the launcher stops the process (grace, SIGTERM, SIGKILL of its group)."""
        if self._exit.done():
            return
        try:
            self._ray.get(self.launcher.stop.remote(graceful_timeout, term_timeout),
                          timeout=graceful_timeout + term_timeout + _CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a lost launcher took its process with it
            logger.debug("stage %d: remote stop failed", self.stage_id, exc_info=True)
        self.join(_CALL_TIMEOUT_S)

    def kill_group(self) -> None:
        """Without waiting: the launcher kills the process group if it still runs."""
        if not self._exit.done():
            try:
                self.launcher.kill_group.remote()
            except Exception:  # noqa: BLE001 - Ray may be shut down (interpreter exit): the launcher died with it
                pass


class RayStageClient(StageEngineCoreClient):
    """One replica of a stage placed through Ray (see the module docstring)."""

    def __init__(self, stage_id: int, process: StageProcessSpec, *, placement: RayPlacement, replica: int,
                 curve: CurveKeys, host: str | None = None, startup_timeout: float | None = None) -> None:
        super().__init__(stage_id, process=process, transport="tcp", host=host or placement.node_ip, curve=curve,
                         startup_timeout=startup_timeout)
        self.placement = placement
        self.group: RayStageGroup = placement.groups[stage_id]
        self.replica = replica
        self.host_id = placement.node_id
        self.heartbeat_timeout = HEARTBEAT_TIMEOUT_S
        self.launcher: Any = None

    async def start(self) -> None:
        """Have Ray place the launcher in the replica's bundle, take the stage's public key, then
        bind, launch and wait for READY as any stage client."""
        self.launcher = self.group.launcher(self.replica)
        try:
            public = await asyncio.wait_for(self.launcher.make_keypair.remote(), self.startup_timeout)
        except BaseException as exc:
            self._kill_launcher()
            if isinstance(exc, asyncio.TimeoutError):
                raise StageStartupError(self.stage_id, f"stage {self.stage_id} replica {self.replica} was not "
                                                       f"placed within {self.startup_timeout:g} s: "
                                                       f"{self.group.describe_wait()}") from None
            if isinstance(exc, Exception):
                raise StageStartupError(self.stage_id, f"stage {self.stage_id} replica {self.replica}: its Ray "
                                                       f"launcher failed: {exc}") from exc
            raise
        self.curve = self.curve.admitting(public)
        await super().start()

    def _launch_spec(self) -> StageProcessSpec:
        spec = self.process_spec
        env = dict(spec.env)
        cpus = self.group.resources.get("CPU")
        if cpus and "OMP_NUM_THREADS" not in env:
            # Ray sets OMP_NUM_THREADS in its workers; say explicitly what the stage gets: its CPUs.
            env["OMP_NUM_THREADS"] = str(max(1, int(cpus)))
        return spec.replace(stage_id=self.stage_id, env=env, connectors=self.connectors,
                            transport=self._stage_transport(), curve=None, heartbeat_interval=HEARTBEAT_INTERVAL_S)

    def _stage_transport(self) -> StageTransport:
        return StageTransport(input_address=self._reachable(self.input_address),
                              output_address=self._reachable(self.output_address), shm_prefix=self.shm_prefix)

    def _reachable(self, address: str) -> str:
        """A bound address as the stage must dial it: a wildcard bind becomes this node's address."""
        for wildcard in ("tcp://0.0.0.0:", "tcp://[::]:"):
            if address.startswith(wildcard):
                return f"tcp://{self.placement.node_ip}:{address[len(wildcard):]}"
        return address

    async def _start_process(self, spec: StageProcessSpec) -> RemoteStageProcess:
        try:
            launched = await self.launcher.start.remote(spec, self.curve.server.public, self.host_id)
        except Exception as exc:  # noqa: BLE001 - named and re-raised
            raise StageStartupError(self.stage_id, f"stage {self.stage_id} replica {self.replica}: its launcher "
                                                   f"could not start the process: {exc}") from exc
        logger.info("stage %d replica %d: pid %d on Ray node %s (%s)", self.stage_id, self.replica, launched.pid,
                    launched.node_id, launched.node_ip)
        return RemoteStageProcess(self.stage_id, self.placement.ray, self.launcher, launched)

    def _release_now(self) -> None:
        super()._release_now()
        self._kill_launcher()

    def _kill_launcher(self) -> None:
        """The launcher goes with its client, so the replica's bundle is free for the next one."""
        launcher, self.launcher = self.launcher, None
        if launcher is not None:
            try:
                self.placement.ray.kill(launcher, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone (with its node, or Ray shut down)
                pass
