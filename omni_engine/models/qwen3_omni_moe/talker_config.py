"""The talker's own ``config.json``, derived from a Qwen3-Omni-MoE checkpoint's ``talker_config``.

As for Qwen2.5-Omni's talker (vLLM sizes everything from one model config, and the checkpoint's is
the whole model's), the talker stage points ``hf_config_path`` at a config of the talker alone:
its MoE decoder's ``text_config`` flattened (vLLM's Qwen3-MoE decoder reads it, shared expert
included), with what the talker model of ours reads beside it (codec ids, code groups, the code
predictor's config, the thinker's width and tts token ids, speakers). The multimodal rope section
moves out of ``rope_parameters`` (``talker_mrope_section``): vLLM would otherwise compute positions
from multimodal inputs the talker does not have. Derived once per config, in the cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_engine.models.derived_config import derived_config_dir

ARCHITECTURE = "OmniEngineQwen3OmniMoeTalker"
VERSION = 1
TALKER_KEYS = ("num_code_groups", "thinker_hidden_size", "accept_hidden_layer", "codec_eos_token_id",
               "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id", "codec_pad_id", "codec_bos_id",
               "speaker_id", "audio_token_id", "image_token_id", "video_token_id")
TOP_KEYS = ("tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id", "im_start_token_id", "im_end_token_id",
            "system_token_id", "user_token_id", "assistant_token_id")
# What transformers' configs default these to where a checkpoint leaves them out (the published one does).
TOP_DEFAULTS = {"tts_pad_token_id": 151671, "tts_bos_token_id": 151672, "tts_eos_token_id": 151673,
                "im_start_token_id": 151644, "im_end_token_id": 151645, "system_token_id": 8948,
                "user_token_id": 872, "assistant_token_id": 77091}


def talker_config(checkpoint_config: dict[str, Any]) -> dict[str, Any]:
    """The talker's config.json content from the checkpoint's."""
    talker = checkpoint_config["talker_config"]
    missing = [key for key in ("text_config", "code_predictor_config", "speaker_id") if not talker.get(key)]
    if missing:
        raise ValueError(f"talker_config has no {', '.join(missing)}: not a Qwen3-Omni checkpoint with a talker")
    config = dict(talker["text_config"])
    config.update({key: talker[key] for key in TALKER_KEYS if key in talker})
    config.update({key: checkpoint_config.get(key, TOP_DEFAULTS[key]) for key in TOP_KEYS})
    config["code_predictor_config"] = dict(talker["code_predictor_config"])
    config["architectures"] = [ARCHITECTURE]
    config["model_type"] = "qwen3_omni_moe_talker_text"
    rope = dict(config.pop("rope_scaling", None) or config.get("rope_parameters") or {})
    section = rope.pop("mrope_section", None)
    for key in ("interleaved", "mrope_interleaved", "type"):
        rope.pop(key, None)
    rope.setdefault("rope_theta", config.pop("rope_theta", 1000000.0))
    rope["rope_type"] = "default"
    config["rope_parameters"] = rope
    config["talker_mrope_section"] = list(section) if section else None
    return config


def talker_config_dir(checkpoint: str | Path, cache_dir: Path | None = None) -> Path:
    """A directory with the talker's ``config.json`` (made if missing); pass it as ``hf_config_path``."""
    source = json.loads((Path(checkpoint) / "config.json").read_text())
    return derived_config_dir("qwen3_omni_moe_talker", talker_config(source), VERSION, cache_dir)
