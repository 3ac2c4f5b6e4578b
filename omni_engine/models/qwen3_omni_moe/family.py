"""Qwen3-Omni-MoE's stages as vLLM-Omni's configs name them (``model_stage``).

- ``thinker``: vLLM's thinker under our architecture (its processor without torchvision where
  none imports; it records the layer the talker accepts: ``vllm_thinker``);
- ``talker``: our talker model (MoE decoder and code predictor), with its own config for vLLM
  (``talker_config``) and the request adapter that turns the thinker's states into its inputs
  (``talker_requests``); no tokenizer.

What a config sets itself is kept. Imports no vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_engine.models.qwen3_omni_moe.talker_config import talker_config_dir

THINKER = "OmniEngineQwen3OmniMoeThinker"
TALKER_REQUESTS = "omni_engine.models.qwen3_omni_moe.talker_requests:TalkerRequests"
MODEL_STAGES = ("thinker", "talker")

# The thinker config's placeholder ids and the tokenizer tokens that must sit at them.
PLACEHOLDERS = {"audio_token_id": "<|audio_pad|>", "image_token_id": "<|image_pad|>",
                "video_token_id": "<|video_pad|>"}


def stage_engine_args(model_stage: str, args: dict[str, Any], model_dir: str) -> dict[str, Any]:
    if model_stage == "thinker":
        check_token_ids(model_dir)
        args.setdefault("hf_overrides", {"architectures": [THINKER]})
    elif model_stage == "talker":
        args.setdefault("hf_config_path", str(talker_config_dir(model_dir)))
        args.setdefault("skip_tokenizer_init", True)
        args.setdefault("generation_config", "vllm")  # the checkpoint's generation_config is the thinker's
        args.setdefault("request_adapter", TALKER_REQUESTS)
    else:
        raise ValueError(f"unknown model_stage {model_stage!r} for Qwen3-Omni-MoE; "
                         f"expected one of {list(MODEL_STAGES)}")
    return args


def check_token_ids(model_dir: str) -> None:
    """The thinker's placeholder ids are the tokenizer's: a mismatch (transformers' default audio id
    151646 is Qwen2.5-Omni's, not Qwen3's 151675) would expand a multimodal part at the wrong token
    deep in vLLM's processor; refused here, naming both ids."""
    root = Path(model_dir)
    try:
        thinker = json.loads((root / "config.json").read_text())["thinker_config"]
        added = json.loads((root / "tokenizer.json").read_text()).get("added_tokens", [])
    except (OSError, ValueError, KeyError):
        return  # not a local checkpoint with these files: vLLM reports what is missing
    ids = {token["content"]: token["id"] for token in added}
    for key, token in PLACEHOLDERS.items():
        if key in thinker and token in ids and ids[token] != thinker[key]:
            raise ValueError(f"{model_dir}: thinker_config.{key} is {thinker[key]} but the tokenizer has {token} "
                             f"at {ids[token]}; the checkpoint's config and tokenizer do not belong together")
