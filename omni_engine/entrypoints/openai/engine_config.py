"""What vLLM's OpenAI server reads from an engine client, built from the pipeline's text stage.

vLLM's serving layer (``init_app_state``, ``OpenAIServingChat``, ...) reads
``vllm_config``, ``model_config``, ``renderer`` (chat template and tokenizer)
and ``input_processor`` from its engine client. Our client runs the model in
a stage process, so the server process builds the same objects the way
``AsyncLLM.__init__`` does -- ``AsyncEngineArgs(**engine_args).create_engine_config()``,
``renderer_from_config`` and ``InputProcessor`` -- without starting a second
engine: no weights are loaded, no engine core is started.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omni_engine.config import PipelineConfig, StageConfig
    from omni_engine.pipeline.stage_clients import StartedPipeline


@dataclass
class TextStageConfig:
    """The text stage's vLLM objects, as an ``AsyncLLM`` of that stage would hold them."""

    stage_id: int
    vllm_config: Any
    model_config: Any
    renderer: Any
    input_processor: Any
    served_model_name: str | list[str]


def text_stage_of(config: PipelineConfig) -> StageConfig:
    """The stage whose text vLLM's server returns: the first final ``llm`` stage with
    text output, else the first ``llm`` stage."""
    llm = [s for s in config.stage_args if s.stage_type == "llm"]
    if not llm:
        raise ValueError("the pipeline has no llm stage; vLLM's OpenAI server needs a text stage to serve")
    for stage in llm:
        if stage.final_output and (stage.final_output_type or "text") == "text":
            return stage
    return llm[0]


def default_served_model_name(stage: StageConfig) -> str:
    """``engine_args.served_model_name`` if set, else the model as the YAML names it
    (a recipe name such as ``smollm2`` stays that, not the prepared directory)."""
    name = stage.engine_args.get("served_model_name")
    if isinstance(name, list) and name:
        name = name[0]
    return str(name or stage.engine_args.get("model") or f"stage-{stage.stage_id}")


def with_served_model_name(config: PipelineConfig, names: list[str]) -> PipelineConfig:
    """``config`` with its text stage serving under ``names`` (vLLM's ``served_model_name``)."""
    text = text_stage_of(config)
    stages = [s.replace(engine_args={**s.engine_args, "served_model_name": list(names)}) if s is text else s
              for s in config.stage_args]
    return config.replace(stage_args=stages)


def with_engine_flags(config: PipelineConfig, flags: Mapping[str, Any], where: str) -> PipelineConfig:
    """``config`` with vLLM engine flags from the command line (engine-args name -> value) set on
    its one llm stage, so a ``vllm serve`` command line moves over as it is. A pipeline with several
    llm stages is refused (ValueError naming the flags): a flag cannot say which stage it means."""
    if not flags:
        return config
    llm = [s for s in config.stage_args if s.stage_type == "llm"]
    named = ", ".join("--" + dest.replace("_", "-") for dest in flags)
    if len(llm) != 1:
        fields = ", ".join(f"engine_args.{dest}" for dest in flags)
        raise ValueError(f"{named}: vLLM engine flags set the engine of a pipeline's one llm stage, and {where} has "
                         f"{len(llm)} ({', '.join(f'stage {s.stage_id}' for s in llm)}); a flag cannot say which: "
                         f"set {fields} of the stage you mean in {where}")
    stage = llm[0]
    stages = [s.replace(engine_args={**s.engine_args, **flags}) if s is stage else s for s in config.stage_args]
    return config.replace(stage_args=stages)


# An llm stage's engine_args that its stage engine takes itself (engines.hidden_states, engines.lead_limit),
# which vLLM's AsyncEngineArgs does not know: the server's frontend builds its config without them.
STAGE_ENGINE_KEYS = ("engine_output_type", "request_adapter", "lead_limit")


def build_text_stage_config(stage: StageConfig,
                            served_model_name: str | list[str] | None = None) -> TextStageConfig:
    """Build the text stage's ``VllmConfig``, renderer and input processor (no engine).

    Blocking (it reads the model's config and tokenizer, ~1 s after vLLM is
    imported); callers in an event loop may run it in a thread. ``stage`` comes
    from a config whose models are prepared (``stage_specs.prepare_models``).
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.renderers import renderer_from_config
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.input_processor import InputProcessor

    engine_args = stage.engine_args_for_engine()
    for key in STAGE_ENGINE_KEYS:
        engine_args.pop(key, None)
    # A cached item would reach the stage without its data (vLLM's frontend cache assumes its own
    # engine holds it); the stage's vLLM caches what it is sent (entrypoints.mm_wire).
    engine_args["mm_processor_cache_gb"] = 0
    name = served_model_name or engine_args.get("served_model_name") or default_served_model_name(stage)
    engine_args["served_model_name"] = name
    try:
        args = AsyncEngineArgs(**engine_args)
    except TypeError as exc:
        raise ValueError(f"stage {stage.stage_id}: invalid engine_args for vLLM: {exc}") from exc
    vllm_config = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    renderer = renderer_from_config(vllm_config)
    input_processor = InputProcessor(vllm_config, renderer)
    return TextStageConfig(
        stage_id=stage.stage_id,
        vllm_config=vllm_config,
        model_config=vllm_config.model_config,
        renderer=renderer,
        input_processor=input_processor,
        served_model_name=name,
    )


async def start_with_text_stage(
        starting: Awaitable[StartedPipeline], text_stage: StageConfig | None,
) -> tuple[StartedPipeline, TextStageConfig | None]:
    """Await ``starting`` while the text stage's vLLM objects load in a thread (both take
    seconds); if those fail, the started stages are stopped again."""
    if text_stage is None:
        return await starting, None
    pipeline, text = await asyncio.gather(
        starting, asyncio.to_thread(build_text_stage_config, text_stage), return_exceptions=True)
    if isinstance(pipeline, BaseException):
        raise pipeline
    if isinstance(text, BaseException):
        await pipeline.stop()
        raise text
    return pipeline, text
