"""Stage engines: what runs inside a stage process, chosen by ``stage_type``."""

from __future__ import annotations

from typing import Any

from omni_engine.engines.base import StageEngine, StageEngineError

STAGE_TYPES = ("llm", "generation")


def build_stage_engine(
    stage_type: str,
    stage_id: int,
    engine_args: dict[str, Any],
    runtime: dict[str, Any] | None = None,
    final_output_type: str | None = None,
) -> StageEngine:
    """Build (not start) the engine of one stage."""
    runtime = runtime or {}
    if stage_type == "llm":
        from omni_engine.engines.llm import LLMStageEngine

        return LLMStageEngine(stage_id, engine_args, final_output_type or "text")
    if stage_type == "generation":
        from omni_engine.engines.generation import GenerationStageEngine

        return GenerationStageEngine(stage_id, engine_args, int(runtime.get("max_batch_size", 1)), final_output_type)
    raise ValueError(f"stage {stage_id}: unknown stage_type {stage_type!r}; known: {list(STAGE_TYPES)}")


__all__ = ["STAGE_TYPES", "StageEngine", "StageEngineError", "build_stage_engine"]
