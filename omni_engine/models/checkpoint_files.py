"""Reading parts of a local checkpoint directory: a sub-model's weights, its placeholder ids.

Shared by the model families (a stage that runs one part of a multi-part checkpoint reads only
that part; a checkpoint whose config and tokenizer disagree is refused before vLLM starts).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def load_prefixed_state(model_dir: str | Path, prefix: str) -> dict[str, Any]:
    """The checkpoint's tensors named ``prefix...`` (float32), with the prefix cut."""
    from safetensors import safe_open

    state = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.startswith(prefix):
                    state[name[len(prefix):]] = f.get_tensor(name).float()
    return state


def load_submodule(module: Any, model_dir: str | Path, prefix: str, what: str) -> Any:
    """``module`` (float32, eval) with the checkpoint's ``prefix*`` weights; ValueError naming
    ``what`` where there are none or they do not fit."""
    module = module.float().eval()
    state = load_prefixed_state(model_dir, prefix)
    if not state:
        raise ValueError(f"{model_dir}: no {prefix}* weights ({what})")
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: {what} weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return module


def check_placeholder_ids(model_dir: str, placeholders: Mapping[str, str]) -> None:
    """``thinker_config``'s placeholder ids (``placeholders``: config key -> token) are the tokenizer's:
    a mismatch would expand a multimodal part at the wrong token (or at none) deep in vLLM's
    processor; refused here, naming both ids."""
    root = Path(model_dir)
    try:
        thinker = json.loads((root / "config.json").read_text())["thinker_config"]
        added = json.loads((root / "tokenizer.json").read_text()).get("added_tokens", [])
    except (OSError, ValueError, KeyError):
        return  # not a local checkpoint with these files: vLLM reports what is missing
    ids = {token["content"]: token["id"] for token in added}
    for key, token in placeholders.items():
        if key in thinker and token in ids and ids[token] != thinker[key]:
            raise ValueError(f"{model_dir}: thinker_config.{key} is {thinker[key]} but the tokenizer has {token} "
                             f"at {ids[token]}; the checkpoint's config and tokenizer do not belong together")
