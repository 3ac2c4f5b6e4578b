"""A pipeline on the legacy architecture, behind the same client as the new one."""

from __future__ import annotations

from pathlib import Path

from omni_engine.config import ConfigError, PipelineConfig, StageConfig, load_pipeline_config
from omni_engine.entrypoints.multi_stage_engine_client import (
    MultiStageEngineClient,
    Progress,
)
from omni_engine.legacy.omni_stage import LegacyOutputHandler, OmniStage
from omni_engine.stage_engine.stage_spec import StageProcessSpec

_NOT_LEGACY = "is not supported by the legacy architecture (VLLM_OMNI_USE_NEW_ARCHITECTURE=0), which"


def check_legacy_config(config: PipelineConfig) -> None:
    """Refuse what the legacy architecture would silently ignore: its stages are
    local processes fed by ``multiprocessing.Queue`` with pickle, so transports,
    CURVE and tensor connectors do not exist there."""
    source = config.source_path or "<dict>"
    errors = []
    connectors = config.runtime.connectors
    if connectors.use_shm is not None or connectors.shm_threshold is not None:
        errors.append(f"{source}: runtime.connectors {_NOT_LEGACY} pickles every tensor")
    if config.runtime.placement.backend != "local":
        errors.append(f"{source}: runtime.placement {_NOT_LEGACY} starts every stage as a local process")
    if config.runtime.security.curve:
        errors.append(f"{source}: runtime.security.curve {_NOT_LEGACY} has no sockets to secure")
    for i, stage in enumerate(config.stage_args):
        if stage.runtime.transport != "ipc" or stage.runtime.host is not None:
            field = "host" if stage.runtime.transport == "ipc" else "transport"
            errors.append(f"{source}: stage {stage.stage_id}: stage_args[{i}].runtime.{field} {_NOT_LEGACY} "
                          "runs every stage on this host over multiprocessing.Queue")
        if not stage.runtime.process:
            errors.append(f"{source}: stage {stage.stage_id}: stage_args[{i}].runtime.process: false {_NOT_LEGACY} "
                          "runs every stage in a process of its own")
        if stage.runtime.num_replicas != 1:
            errors.append(f"{source}: stage {stage.stage_id}: stage_args[{i}].runtime.num_replicas {_NOT_LEGACY} "
                          "runs one process per stage")
    if errors:
        raise ConfigError(errors, source)


async def start_legacy_pipeline(config: PipelineConfig | str | Path, *,
                                progress: Progress | None = None) -> MultiStageEngineClient:
    """Start every stage as a legacy (``multiprocessing.Queue``) stage process.

    Routing is the same ``PipelineOrchestrator`` as in the new architecture,
    so the two differ only in how stages are reached (queues and pickle vs.
    ZMQ, msgpack and shared memory) and give the same outputs and errors.
    """
    config = config if isinstance(config, PipelineConfig) else load_pipeline_config(config)
    check_legacy_config(config)
    handler = LegacyOutputHandler()

    def make_stage(stage: StageConfig, spec: StageProcessSpec) -> OmniStage:
        return OmniStage(stage.stage_id, spec, output_handler=handler)

    return await MultiStageEngineClient.from_config(config, progress=progress, make_stage_client=make_stage)
