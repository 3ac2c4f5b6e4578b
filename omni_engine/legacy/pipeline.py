"""A pipeline on the legacy architecture, behind the same client as the new one."""

from __future__ import annotations

from pathlib import Path

from omni_engine.config import PipelineConfig, StageConfig
from omni_engine.entrypoints.multi_stage_engine_client import (
    MultiStageEngineClient,
    Progress,
)
from omni_engine.legacy.omni_stage import LegacyOutputHandler, OmniStage
from omni_engine.stage_engine.stage_process import StageProcessSpec


async def start_legacy_pipeline(config: PipelineConfig | str | Path, *,
                                progress: Progress | None = None) -> MultiStageEngineClient:
    """Start every stage as a legacy (``multiprocessing.Queue``) stage process.

    Routing is the same ``PipelineOrchestrator`` as in the new architecture,
    so the two differ only in how stages are reached (queues and pickle vs.
    ZMQ, msgpack and shared memory) and give the same outputs and errors.
    Stages are always local: ``runtime.transport`` does not apply.
    """
    handler = LegacyOutputHandler()

    def make_stage(stage: StageConfig, spec: StageProcessSpec) -> OmniStage:
        return OmniStage(stage.stage_id, spec, output_handler=handler)

    return await MultiStageEngineClient.from_config(config, progress=progress, make_stage_client=make_stage)
