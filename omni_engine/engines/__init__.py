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


def preload_stage_engine(spec: StageProcessSpec) -> None:
    """Import what building and starting the engine of ``spec`` will import, and start vLLM's EngineCore
    forkserver, loading no model and touching no device: what a warm spare does before it is taken
    (its replica's device variables are applied only then)."""
    if spec.stage_type == "llm":
        from omni_engine.engines.warm_engine_core import prepare_engine_core_start

        prepare_engine_core_start(spec.engine_core_start)  # first: a forkserver's import overlaps ours
        from omni_engine.engines.llm import LLMStageEngine

        LLMStageEngine.preload()
    elif spec.stage_type == "generation":
        from omni_engine.engines.generation import MODEL_FACTORY_KEY
        from omni_engine.utils import resolve_dotted

        factory = spec.engine_args.get(MODEL_FACTORY_KEY)
        if isinstance(factory, str):  # a bad path fails when the spare is taken, naming the stage
            try:
                resolve_dotted(factory, f"stage {spec.stage_id} engine_args.{MODEL_FACTORY_KEY}")
            except Exception:  # noqa: BLE001 - reported by build_stage_engine, where the client sees it
                pass


__all__ = ["STAGE_TYPES", "StageEngine", "StageEngineError", "build_stage_engine", "preload_stage_engine"]
