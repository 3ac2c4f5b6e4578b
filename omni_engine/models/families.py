"""Model families: the pipeline a checkpoint's architecture runs as, and what its stages' ``model_stage`` means.

- By ``architectures`` (config.json): the family's stage config, which ``AsyncOmni(model=DIR)``,
  ``omni-engine serve DIR`` and ``omni-engine generate --model DIR`` run (as ``vllm serve --omni``
  picks one), shipped in the family's package.
- By ``model_type``: vLLM-Omni's stage configs name the part of a model a stage runs
  (``engine_args.model_stage``: ``thinker``, ``talker``, ...); the family of the checkpoint says what
  that means for vLLM (which architecture, which config, which request adapter).

Each family answers in a module of its own, so adding a family adds entries here and touches no
pipeline code. Imports no vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_engine.utils import resolve_dotted

# checkpoint architecture -> its family's stage config ("package:file", package data).
# The published Qwen2.5-Omni checkpoints name the model's first class name; transformers' is the second.
FAMILY_CONFIGS = {
    "Qwen2_5OmniModel": "omni_engine.models.qwen2_5_omni:qwen2_5_omni.yaml",
    "Qwen2_5OmniForConditionalGeneration": "omni_engine.models.qwen2_5_omni:qwen2_5_omni.yaml",
    "Qwen3OmniMoeForConditionalGeneration": "omni_engine.models.qwen3_omni_moe:qwen3_omni_moe.yaml",
}

# checkpoint model_type -> "module:function(model_stage, engine_args, model_dir) -> engine_args"
# (ValueError naming what is wrong with model_stage)
FAMILIES = {
    "qwen2_5_omni": "omni_engine.models.qwen2_5_omni.family:stage_engine_args",
    "qwen3_omni_moe": "omni_engine.models.qwen3_omni_moe.family:stage_engine_args",
}


def checkpoint_model_type(model_dir: str | Path) -> str | None:
    """``model_type`` of a checkpoint directory's config.json (None: not a directory with one)."""
    return (checkpoint_config(model_dir) or {}).get("model_type")


def checkpoint_config(model_dir: str | Path) -> dict[str, Any] | None:
    """A checkpoint directory's config.json (None: not a directory with a readable one)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def family_config_file(architectures: list[str] | tuple[str, ...]) -> Path | None:
    """The stage config of the family that serves one of ``architectures`` (None: no family does)."""
    from importlib.resources import files

    for arch in architectures:
        if arch in FAMILY_CONFIGS:
            package, _, name = FAMILY_CONFIGS[arch].partition(":")
            return Path(str(files(package) / name))
    return None


def family_architectures() -> list[str]:
    return sorted(FAMILY_CONFIGS)


def resolve_model_stage(engine_args: dict[str, Any]) -> dict[str, Any]:
    """``engine_args`` with ``model_stage`` resolved by the model's family (unchanged without one);
    ValueError says what is wrong with it."""
    if "model_stage" not in engine_args:
        return engine_args
    args = dict(engine_args)
    model_stage, model = args.pop("model_stage"), args.get("model")
    model_type = checkpoint_model_type(model) if isinstance(model, str) else None
    if model_type not in FAMILIES:
        raise ValueError(f"{model!r} is not a checkpoint of a model family with stages "
                         f"(its model_type is {model_type!r}; families: {', '.join(sorted(FAMILIES))})")
    try:
        return resolve_dotted(FAMILIES[model_type], "family")(model_stage, args, model)
    except FileNotFoundError as exc:  # a file the family needs (a speakers file)
        raise ValueError(str(exc)) from exc
