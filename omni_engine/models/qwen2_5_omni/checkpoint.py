"""Build the tiny, seeded, random-weight Qwen2.5-Omni checkpoint (``prepare-model qwen2.5-omni-tiny``).

The real weights cannot be had offline, so the family's stages are checked against transformers
on a checkpoint of the real architecture with random weights. It has the published checkpoint's
layout, so the code that loads it loads ``Qwen/Qwen2.5-Omni-7B`` unchanged:

- ``config.json`` (``Qwen2_5OmniForConditionalGeneration``) + ``model.safetensors``: thinker
  (text model, audio encoder, vision encoder), talker, token2wav (DiT + BigVGAN), seeded;
- the Qwen2 tokenizer (the vocabulary and merges of the ``qwen2.5-coder-0.5b`` recipe's GGUF,
  read from the metadata of its first part only) with Qwen2.5-Omni's special tokens at their
  ids, named in ``tokenizer_config.json`` as transformers' Omni processor looks them up;
- ``preprocessor_config.json`` (Whisper features, 128 mel bins; Qwen2-VL image processing) and
  ``chat_template.json``, as published;
- ``spk_dict.pt``: speakers ``Chelsie`` and ``Ethan`` (the published names), each a talker bos
  token, a speaker embedding (``cond``) and a reference mel (``ref_mel``).

Rebuilding gives the same bytes: the weights come from one seeded generator, every file is
written in a fixed order (``torch.save``'s zip records carry no time).
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Any

from omni_engine.models.qwen2_5_omni import tiny_config as tc
from omni_engine.models.qwen_tokenizer import write_json, write_qwen2_tokenizer

SEED = 0
SPEAKERS = ("Chelsie", "Ethan")
# The talker's text-side bos token per speaker: rows of the thinker's embedding past the
# tokenizer's vocabulary, as the published speakers use.
SPEAKER_BOS_TOKENS = {"Chelsie": 151872, "Ethan": 151870}
REF_MEL_FRAMES = 120
OUTPUT_CONV_GAIN = 0.02
VOCODER_SEED = 1

# Qwen2.5-Omni's names for the ids Qwen2's tokenizer spells otherwise (<|object_ref_start|> ...).
OMNI_TOKEN_NAMES = {
    tc.AUDIO_TOKEN_ID: "<|AUDIO|>",
    tc.AUDIO_BOS_TOKEN_ID: "<|audio_bos|>",
    tc.AUDIO_EOS_TOKEN_ID: "<|audio_eos|>",
    tc.VISION_BOS_TOKEN_ID: "<|vision_bos|>",
    tc.VISION_EOS_TOKEN_ID: "<|vision_eos|>",
    tc.IMAGE_TOKEN_ID: "<|IMAGE|>",
    tc.VIDEO_TOKEN_ID: "<|VIDEO|>",
}
# What transformers' Qwen2_5OmniProcessor reads off the tokenizer (tokenizer.audio_token, ...).
PROCESSOR_TOKENS = {
    "audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
    "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
}

# The published preprocessor_config.json: Whisper's features (128 bins, 16 kHz, up to 300 s)
# and Qwen2-VL's image processing, one file for both.
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "chunk_length": 300,
    "dither": 0.0,
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "hop_length": 160,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "max_pixels": 12845056,
    "merge_size": 2,
    "min_pixels": 3136,
    "n_fft": 400,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "patch_size": 14,
    "processor_class": "Qwen2_5OmniProcessor",
    "return_attention_mask": True,
    "sampling_rate": 16000,
    "temporal_patch_size": 2,
}


def chat_template() -> str:
    """Qwen2.5-Omni's chat template (system turn, then text, audio, image and video parts)."""
    return resources.files(__package__).joinpath("chat_template.jinja").read_text()


def build_tiny_checkpoint(staging: Path, tokenizer_gguf: Path) -> dict[str, Any]:
    """Write the checkpoint into ``staging``; the tokenizer comes from ``tokenizer_gguf``'s metadata.

    Returns a summary (parameter counts by sub-model) for the progress line.
    """
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    config = Qwen2_5OmniConfig(**tc.tiny_config_kwargs())
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen2_5OmniForConditionalGeneration(config).eval()
        # A seed of its own: the vocoder's draw does not move when another sub-model changes size.
        torch.manual_seed(VOCODER_SEED)
        _audible_vocoder(model.token2wav)
        speakers = _speakers(config)
    model.save_pretrained(str(staging))
    write_qwen2_tokenizer(staging, tokenizer_gguf, names=OMNI_TOKEN_NAMES, processor_tokens=PROCESSOR_TOKENS,
                          chat_template=chat_template())
    write_json(staging / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    write_json(staging / "chat_template.json", {"chat_template": chat_template()})
    torch.save(speakers, str(staging / "spk_dict.pt"))
    return {part: sum(p.numel() for p in getattr(model, part).parameters())
            for part in ("thinker", "talker", "token2wav")}


def _audible_vocoder(token2wav: Any) -> None:
    """Re-draw token2wav's convolutions variance-preserving (std 1/sqrt(fan_in)).

    transformers' init leaves BigVGAN's output near 1e-7: the tiny model would speak silence, and
    a waveform check against silence passes whatever the code does. The output convolution gets a
    small gain, so that the waveform stays inside BigVGAN's final clamp to [-1, 1] (at gain 1, 69 %
    of the samples sat on it, and a clamped sample hides any difference before it).
    """
    import torch

    for name, module in token2wav.named_modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            weight = module.weight
            fan_in = weight.shape[1] * weight.shape[2] if isinstance(module, torch.nn.Conv1d) else (
                weight.shape[0] * weight.shape[2])
            with torch.no_grad():
                gain = OUTPUT_CONV_GAIN if name.endswith("conv_post") else 1.0
                weight.normal_(0.0, gain / math.sqrt(fan_in))
                if module.bias is not None:
                    module.bias.zero_()


def _speakers(config: Any) -> dict[str, dict[str, Any]]:
    """``spk_dict.pt``'s content: per speaker a bos token, a condition vector and a reference mel."""
    import torch

    dit = config.token2wav_config.dit_config
    return {
        name: {
            "bos_token": SPEAKER_BOS_TOKENS[name],
            "cond": torch.randn(dit.enc_emb_dim),
            "ref_mel": torch.randn(1, REF_MEL_FRAMES, dit.mel_dim),
        }
        for name in SPEAKERS
    }
