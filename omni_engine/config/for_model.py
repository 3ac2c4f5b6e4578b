"""The pipeline a model alone names: ``AsyncOmni(model=...)``, ``omni-engine serve MODEL``,
``omni-engine generate --model MODEL``.

As ``vllm serve --omni`` does it: a checkpoint whose ``architectures`` a model family serves runs as
that family's stage config (``omni_engine.models.families``), every stage's ``model`` the one given;
any other model is one vLLM text stage, as ``vllm serve`` runs it. A checkpoint neither can run is
refused here, in one line naming its architecture and the families there are, before any stage
starts: a model with speech parts (a ``talker_config``) that no family serves (one text stage would
silently drop its speech), or an architecture vLLM does not know (vLLM would say so only in the
stage's log, in a traceback). A model whose architectures cannot be read here (a hub id) is one
vLLM stage, and vLLM resolves it.

vLLM's model registry is imported only to check a checkpoint no family serves.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from omni_engine.config.loader import (
    load_pipeline_config,
    parse_pipeline_config,
    read_pipeline_yaml,
)
from omni_engine.config.model import ConfigError, PipelineConfig

# A checkpoint with one of these in its config.json has parts beyond a text model.
SPEECH_PARTS = ("talker_config", "token2wav_config", "code2wav_config")


def model_architectures(model: str) -> tuple[list[str], dict[str, Any] | None]:
    """The ``architectures`` a model names and its config.json (None where there is none here): a
    checkpoint directory's, a ``prepare-model`` recipe's; ``[]`` for anything else."""
    from omni_engine.models.families import checkpoint_config
    from omni_engine.models.prepare import RECIPES

    config = checkpoint_config(model)
    if config is not None:
        archs = config.get("architectures")
        return (list(archs) if isinstance(archs, list) else []), config
    recipe = RECIPES.get(model) if not Path(model).exists() else None
    return list(getattr(recipe, "architectures", ()) or ()), None


def vllm_knows(architectures: list[str]) -> bool:
    from vllm.model_executor.models.registry import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    return any(arch in supported for arch in architectures)


def pipeline_data_for_model(model: str) -> tuple[str, dict[str, Any]]:
    """The stage config ``model`` runs as (where it comes from, its YAML data with ``model`` set in
    every stage that names one); ``ConfigError`` (one line) for a checkpoint nothing here serves."""
    from omni_engine.models.families import family_architectures, family_config_file

    architectures, config = model_architectures(model)
    family = family_config_file(architectures)
    if family is not None:
        data = copy.deepcopy(read_pipeline_yaml(family))
        for stage in data.get("stage_args") or ():
            if isinstance(stage, dict) and "model" in (stage.get("engine_args") or {}):
                stage["engine_args"]["model"] = model
        return f"{family} (the family of {architectures[0]}, for {model})", data
    families = ", ".join(family_architectures())
    named = f"{model}: architecture {', '.join(architectures) or '?'}"
    if config is not None and any(part in config for part in SPEECH_PARTS):
        parts = ", ".join(p for p in SPEECH_PARTS if p in config)
        raise ConfigError([f"{named} has speech parts ({parts}) that no model family serves (families: "
                           f"{families}); a stage config with one llm stage of it serves its text"], model, "model")
    if architectures and not vllm_knows(architectures):
        raise ConfigError([f"{named} is served neither by a model family (families: {families}) nor by vLLM as a "
                           "text model"], model, "model")
    return f"<one vLLM stage of {model}>", {"stage_args": [{"stage_id": 0, "stage_type": "llm", "final_output": True,
                                                            "final_output_type": "text",
                                                            "engine_args": {"model": model}}]}


def pipeline_config_for_model(model: str, deploy_config: str | Path | None = None,
                              notes: list[str] | None = None) -> PipelineConfig:
    """``pipeline_data_for_model``'s config, with vLLM-Omni's deploy YAML over it if given (its notes on
    fields with nothing to act on appended to ``notes``), validated."""
    source, data = pipeline_data_for_model(model)
    return parse_with_deploy(data, source, deploy_config, notes)


def load_config_or_model(target: str | Path, deploy_config: str | Path | None = None,
                         notes: list[str] | None = None) -> PipelineConfig:
    """The pipeline config file ``target`` names (a ``.yaml``/``.yml`` path, or any file), else the
    pipeline of the model it names: what ``omni-engine serve TARGET [--deploy-config FILE]`` serves."""
    path = Path(target)
    if not (path.is_file() or path.suffix in (".yaml", ".yml")):
        return pipeline_config_for_model(str(target), deploy_config, notes)
    if deploy_config is None:
        return load_pipeline_config(path)
    config = parse_with_deploy(read_pipeline_yaml(path), str(path), deploy_config, notes)
    config.source_path = str(path)
    return config


def parse_with_deploy(data: Any, source: str, deploy_config: str | Path | None = None,
                      notes: list[str] | None = None) -> PipelineConfig:
    """``data`` (a stage config's YAML mapping) validated, with vLLM-Omni's deploy YAML over it if given
    (its notes on fields with nothing to act on appended to ``notes``)."""
    if deploy_config is not None and isinstance(data, dict):
        from omni_engine.config.deploy import apply_deploy_config

        data, said = apply_deploy_config(data, deploy_config)
        source = f"{source} with {deploy_config}"
        if notes is not None:
            notes.extend(said)
    return parse_pipeline_config(data, source)
