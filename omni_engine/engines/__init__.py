"""Stage engines: what runs inside a stage process, chosen by ``stage_type``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_engine.config import STAGE_TYPES
from omni_engine.engines.base import StageEngine, StageEngineError

if TYPE_CHECKING:
    from omni_engine.stage_engine.stage_spec import StageProcessSpec


def build_stage_engine(spec: StageProcessSpec) -> StageEngine:
    """Build (not start) the engine of one stage from its process spec."""
    stage_id = spec.stage_id if spec.stage_id is not None else 0
    if spec.stage_type == "llm":
        from omni_engine.engines.llm import LLMStageEngine

        return LLMStageEngine(stage_id, spec.engine_args, spec.final_output_type or "text")
    if spec.stage_type == "generation":
        from omni_engine.engines.generation import GenerationStageEngine

        return GenerationStageEngine(stage_id, spec.engine_args, spec.max_batch_size or 1, spec.final_output_type)
    raise ValueError(f"stage {stage_id}: unknown stage_type {spec.stage_type!r}; known: {list(STAGE_TYPES)}")


__all__ = ["STAGE_TYPES", "StageEngine", "StageEngineError", "build_stage_engine"]
