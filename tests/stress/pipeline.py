"""Starting the speech pipeline for stress runs, and the prompts they send.

Scripts and CI tests start the same pipeline the same way: the shipped
``stage_configs/smollm2_speech.yaml`` with a low shared-memory threshold, so
every sentence of audio travels through the speech stage's shm pool and a
leaked slot shows up.
"""

from __future__ import annotations

import os

import msgspec
from pathlib import Path
from typing import Any

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from omni_engine.config import PipelineConfig, parse_pipeline_config, read_pipeline_yaml
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "stage_configs" / "smollm2_speech.yaml"
# Audio of one sentence is ~100-300 KB: above this, so it goes through shared memory.
DEFAULT_SHM_THRESHOLD = 4096

QUESTIONS = (
    "Tell me a short story about a cat.",
    "Name three colours and say why you like them.",
    "What is the capital of France?",
    "Describe the sea in two sentences.",
    "Count from one to five in words.",
    "Why is the sky blue?",
    "Give me two tips for sleeping well.",
    "Say hello and introduce yourself.",
)


def set_stress_env_defaults() -> None:
    """A small CPU KV cache (vLLM's default takes most of the machine), quiet tokenizers."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def speech_config(path: str | Path = DEFAULT_CONFIG, model: str | Path | None = None,
                  shm_threshold: int | None = DEFAULT_SHM_THRESHOLD) -> PipelineConfig:
    """The pipeline config at ``path``; ``model`` replaces the LLM stage's model (e.g. a prepared path)."""
    data = read_pipeline_yaml(path)
    if shm_threshold is not None:
        runtime = data.setdefault("runtime", {})
        runtime.setdefault("connectors", {})["shm_threshold"] = shm_threshold
    if model is not None:
        for stage in data["stage_args"]:
            if stage.get("stage_type", "llm") == "llm":
                stage.setdefault("engine_args", {})["model"] = str(model)
    return parse_pipeline_config(data, str(path))


async def start_pipeline(config: PipelineConfig, legacy: bool = False) -> MultiStageEngineClient:
    """Every stage of ``config`` as its own process: ZMQ stages, or legacy ``multiprocessing.Queue`` ones."""
    if legacy:
        from omni_engine.config import ConnectorsConfig
        from omni_engine.legacy import start_legacy_pipeline

        # The legacy architecture pickles every tensor: it refuses connector settings.
        return await start_legacy_pipeline(config.replace(
            runtime=msgspec.structs.replace(config.runtime, connectors=ConnectorsConfig())))
    return await MultiStageEngineClient.from_config(config)


def chat_prompts(config: PipelineConfig, questions: tuple[str, ...] = QUESTIONS) -> list[str]:
    """``questions`` rendered with the LLM stage's chat template, as vLLM's server would."""
    from transformers import AutoTokenizer

    from omni_engine.pipeline.stage_specs import prepare_models

    llm = next(s for s in prepare_models(config).stage_args if s.stage_type == "llm")
    tokenizer = AutoTokenizer.from_pretrained(llm.engine_args["model"])
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in questions]


def text_params(max_tokens: int) -> SamplingParams:
    """Greedy, streamed as deltas (what vLLM's server asks for when streaming)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)


def stage_pids(client: MultiStageEngineClient) -> dict[str, int]:
    """``stage<N>`` -> pid of every stage process of ``client``."""
    return {f"stage{ctx.stage_id}" + (f"r{i}" if i else ""): replica.process.pid
            for ctx in client.stage_contexts for i, replica in enumerate(ctx.client.replicas)
            if replica.process is not None}


def describe(client: MultiStageEngineClient) -> dict[str, Any]:
    return {"architecture": "legacy" if is_legacy(client) else "new", "stages": stage_pids(client)}


def is_legacy(client: MultiStageEngineClient) -> bool:
    from omni_engine.legacy import OmniStage

    return any(isinstance(replica, OmniStage) for ctx in client.stage_contexts for replica in ctx.client.replicas)
