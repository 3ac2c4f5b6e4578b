"""A stage process started before its client exists: ``omni-engine serve`` starts its stages first.

The client side of the package imports vLLM (its errors are vLLM's, so vLLM's server treats them as
its own), and ``omni-engine serve`` imports vLLM's server too: seconds on these machines. A stage
started only after that import waits for it before its own import begins. ``launch_stage`` starts
the process from this vLLM-free module, with the addresses, socket directory and shared-memory
prefix its client will use; the client (``StageEngineCoreClient(..., launched=...)``) binds those
addresses when it starts and adopts the process. A stage that connects before the client has bound
waits in ZMQ (connect before bind is allowed), and its READY is delivered once the client binds.

Only what needs no keys of the client's is started this way: local ipc stages without CURVE.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omni_engine.connectors.settings import ConnectorSettings
from omni_engine.connectors.shm import new_run_prefix, stage_prefix, unlink_prefix
from omni_engine.stage_engine.security import CurveKeys
from omni_engine.stage_engine.stage_process import StageProcess, default_log_dir
from omni_engine.stage_engine.stage_sockets import RUNTIME_DIR_PREFIX, make_addresses
from omni_engine.stage_engine.stage_spec import StageProcessSpec, StageTransport


def new_runtime_dir(stage_id: int) -> Path:
    """A private directory for one stage's socket files (ours, and vLLM's via ``VLLM_RPC_BASE_PATH``)."""
    return Path(tempfile.mkdtemp(prefix=f"{RUNTIME_DIR_PREFIX}{os.getpid()}-s{stage_id}-"))


def launch_spec(spec: StageProcessSpec, runtime_dir: Path, connectors: ConnectorSettings,
                transport: StageTransport, curve: CurveKeys | None) -> StageProcessSpec:
    """``spec`` with its launch fields: where to connect, the connectors both ends agree on, keys."""
    return spec.replace(
        env={"VLLM_RPC_BASE_PATH": str(runtime_dir), **spec.env},
        connectors=connectors,
        transport=transport,
        curve=spec.curve if spec.curve is not None or curve is None else curve.for_stage(),
    )


def start_stage_process(stage_id: int, spec: StageProcessSpec, shm_prefix: str) -> StageProcess:
    """Start the stage's process (a child of this one), its log named after its shared-memory prefix."""
    process = StageProcess(stage_id, spec, default_log_dir() / f"{shm_prefix}.log")
    process.start()
    return process


@dataclass
class LaunchedStage:
    """A started stage process and what its client must use to reach it."""

    stage_id: int
    process: StageProcess
    runtime_dir: Path
    run_prefix: str
    input_address: str
    output_address: str
    adopted: bool = False

    def discard(self) -> None:
        """Stop a launched stage no client adopted (the server could not start), and remove its files."""
        if self.adopted:
            return
        self.process.stop()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        unlink_prefix(stage_prefix(self.run_prefix, self.stage_id))


def discard_launched(launched: dict[int, LaunchedStage]) -> None:
    """Stop every launched stage (early, or a warm spare) that no client adopted, and empty ``launched``."""
    while launched:
        launched.popitem()[1].discard()


def launch_spare(stage_id: int, spec: StageProcessSpec) -> LaunchedStage:
    """A warm spare of the stage: a process that imports what ``spec``'s engine needs and waits; the
    client that adopts it hands it the spec of the replica it replaces (``StageProcess.take``)."""
    return launch_stage(stage_id, spec.replace(spare=True))


def launch_stage(stage_id: int, spec: StageProcessSpec) -> LaunchedStage:
    """Start ``spec`` as a local ipc stage, no CURVE, now; its client adopts it later."""
    if spec.curve is not None:
        raise ValueError(f"stage {stage_id}: a stage with CURVE keys is started by its client")
    runtime_dir = new_runtime_dir(stage_id)
    run_prefix = new_run_prefix()
    input_address, output_address = make_addresses(stage_id, "ipc", runtime_dir, None)
    transport = StageTransport(input_address=input_address, output_address=output_address,
                               shm_prefix=stage_prefix(run_prefix, stage_id))
    try:
        process = start_stage_process(stage_id, launch_spec(spec, runtime_dir, spec.connectors, transport, None),
                                      transport.shm_prefix)
    except BaseException:
        shutil.rmtree(runtime_dir, ignore_errors=True)
        raise
    return LaunchedStage(stage_id, process, runtime_dir, run_prefix, input_address, output_address)
