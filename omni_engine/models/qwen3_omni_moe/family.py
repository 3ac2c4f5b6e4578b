"""Qwen3-Omni-MoE's stages as vLLM-Omni's configs name them (``model_stage``).

- ``thinker``: vLLM's thinker under our architecture (its processor without torchvision where
  none imports; it records the layer the talker accepts: ``vllm_thinker``);
- ``talker``: our talker model (MoE decoder and code predictor), with its own config for vLLM
  (``talker_config``) and the request adapter that turns the thinker's states into its inputs
  (``talker_requests``); no tokenizer.

What a config sets itself is kept. Imports no vLLM.
"""

from __future__ import annotations

from typing import Any

from omni_engine.models.checkpoint_files import check_placeholder_ids
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
    check_placeholder_ids(model_dir, PLACEHOLDERS)
