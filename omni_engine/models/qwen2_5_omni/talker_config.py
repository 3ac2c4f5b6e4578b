"""The talker's own ``config.json``, derived from a Qwen2.5-Omni checkpoint's ``talker_config``.

vLLM sizes everything (KV cache, layers, vocabulary, context) from one model config; a Qwen2.5-Omni
checkpoint's is the whole model's, whose text config is the thinker's. The talker stage therefore
points vLLM's ``hf_config_path`` at a directory holding the talker's config alone, with our talker
architecture, while ``model`` stays the checkpoint (its weights, its ``spk_dict.pt``). The
multimodal rope section moves out of ``rope_parameters`` into ``talker_mrope_section``: vLLM would
otherwise run the talker as a multimodal-rope model, computing its positions from multimodal inputs
it does not have; the talker places its rows itself (``vllm_talker``). The directory is derived once
per config, in the cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_engine.models.derived_config import derived_config_dir

ARCHITECTURE = "OmniEngineQwen2_5OmniTalker"
VERSION = 3


def talker_config(checkpoint_config: dict[str, Any]) -> dict[str, Any]:
    """The talker's config.json content from the checkpoint's."""
    config = dict(checkpoint_config["talker_config"])
    config["architectures"] = [ARCHITECTURE]
    config["model_type"] = "qwen2_5_omni_talker"
    # Read by vLLM's Llama decoder, which the talker runs on (vllm_talker): Qwen2 biases q, k and v only.
    config["qkv_bias"] = True
    rope = dict(config.get("rope_parameters") or {})
    section = rope.pop("mrope_section", None)
    if rope.pop("mrope_interleaved", False):
        raise ValueError("talker_config.rope_parameters.mrope_interleaved: Qwen2.5-Omni's talker rope is not "
                         "interleaved; this checkpoint is not one")
    config["talker_mrope_section"] = list(section) if section else None
    config["rope_parameters"] = {"rope_type": "default", **rope} if rope else {"rope_type": "default"}
    return config


def talker_config_dir(checkpoint: str | Path, cache_dir: Path | None = None) -> Path:
    """A directory with the talker's ``config.json`` (made if missing); pass it as ``hf_config_path``."""
    source = json.loads((Path(checkpoint) / "config.json").read_text())
    return derived_config_dir("qwen2_5_omni_talker", talker_config(source), VERSION, cache_dir)
