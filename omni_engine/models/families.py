"""Model families by checkpoint ``model_type``: what a stage's ``model_stage`` makes of its engine args.

vLLM-Omni's stage configs name the part of a model a stage runs (``engine_args.model_stage``:
``thinker``, ``talker``, ...); the family of the checkpoint says what that means for vLLM (which
architecture, which config, which request adapter). Each family answers in a module of its own,
so adding a family adds an entry here and touches no pipeline code. Imports no vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_engine.utils import resolve_dotted

# checkpoint model_type -> "module:function(model_stage, engine_args, model_dir) -> engine_args"
# (ValueError naming what is wrong with model_stage)
FAMILIES = {
    "qwen2_5_omni": "omni_engine.models.qwen2_5_omni.family:stage_engine_args",
}


def checkpoint_model_type(model_dir: str | Path) -> str | None:
    """``model_type`` of a checkpoint directory's config.json (None: not a directory with one)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


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
