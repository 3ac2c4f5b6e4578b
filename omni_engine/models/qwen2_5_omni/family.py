"""Qwen2.5-Omni's stages as vLLM-Omni's configs name them (``model_stage``).

- ``thinker``: vLLM's thinker under our architecture (its processor without torchvision where
  none imports; ``vllm_thinker``);
- ``talker``: our talker model, with its own config for vLLM (``talker_config``) and the request
  adapter that turns the thinker's states into its inputs (``talker_requests``); no tokenizer.

What a config sets itself is kept. Imports no vLLM.
"""

from __future__ import annotations

from typing import Any

from omni_engine.models.checkpoint_files import check_placeholder_ids
from omni_engine.models.qwen2_5_omni.speakers import load_speakers
from omni_engine.models.qwen2_5_omni.talker_config import talker_config_dir

THINKER = "OmniEngineQwen2_5OmniThinker"
TALKER_REQUESTS = "omni_engine.models.qwen2_5_omni.talker_requests:TalkerRequests"
MODEL_STAGES = ("thinker", "talker")


def stage_engine_args(model_stage: str, args: dict[str, Any], model_dir: str) -> dict[str, Any]:
    if model_stage == "thinker":
        check_token_ids(model_dir)
        args.setdefault("hf_overrides", {"architectures": [THINKER]})
    elif model_stage == "talker":
        load_speakers(model_dir)  # refused now, by name, rather than in vLLM's worker
        args.setdefault("hf_config_path", str(talker_config_dir(model_dir)))
        args.setdefault("skip_tokenizer_init", True)
        args.setdefault("generation_config", "vllm")  # the checkpoint's generation_config is the thinker's
        args.setdefault("request_adapter", TALKER_REQUESTS)
    else:
        raise ValueError(f"unknown model_stage {model_stage!r} for Qwen2.5-Omni; "
                         f"expected one of {list(MODEL_STAGES)}")
    return args


# The thinker config's placeholder ids and the tokenizer tokens that must sit at them.
PLACEHOLDERS = {"audio_token_index": "<|AUDIO|>", "image_token_index": "<|IMAGE|>", "video_token_index": "<|VIDEO|>"}


def check_token_ids(model_dir: str) -> None:
    check_placeholder_ids(model_dir, PLACEHOLDERS)
