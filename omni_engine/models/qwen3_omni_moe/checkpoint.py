"""Build the tiny, seeded, random-weight Qwen3-Omni-MoE checkpoint (``prepare-model qwen3-omni-tiny``).

As the Qwen2.5-Omni one: the real architecture with seeded random weights, in the published
checkpoint's layout, so the code that loads it loads ``Qwen/Qwen3-Omni-30B-A3B-Instruct`` unchanged:

- ``config.json`` (``Qwen3OmniMoeForConditionalGeneration``) + ``model.safetensors``: thinker
  (MoE text model, audio encoder, vision encoder), talker (MoE decoder, shared expert, code
  predictor), code2wav, seeded;
- the Qwen2 tokenizer with Qwen3-Omni's special tokens at their ids (``<|audio_pad|>`` 151675, the
  tts bos / eos / pad 151671-151673, ...), named in ``tokenizer_config.json`` as transformers'
  processor reads them;
- ``preprocessor_config.json`` (Whisper features, 128 bins; Qwen2-VL image processing with 16-pixel
  patches) and the chat template (tools as Qwen3 writes them);
- no speakers file: Qwen3's voices are codec ids of the talker's, named in ``talker_config.speaker_id``.

Rebuilding gives the same bytes: one seeded generator, files in a fixed order.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Any

from omni_engine.models.qwen3_omni_moe import tiny_config as tc
from omni_engine.models.qwen_tokenizer import write_json, write_qwen2_tokenizer

SEED = 0
VOCODER_SEED = 1
OUTPUT_CONV_GAIN = 0.05

# Qwen3-Omni's names for slots the Qwen2 tokenizer leaves as padding or spells otherwise.
OMNI_TOKEN_NAMES = {
    151665: "<tool_response>",
    151666: "</tool_response>",
    151667: "<think>",
    151668: "</think>",
    tc.AUDIO_START_TOKEN_ID: "<|audio_start|>",
    tc.AUDIO_END_TOKEN_ID: "<|audio_end|>",
    tc.TTS_PAD_TOKEN_ID: "<tts_pad>",
    tc.TTS_BOS_TOKEN_ID: "<tts_text_bos>",
    tc.TTS_EOS_TOKEN_ID: "<tts_text_eod>",
    151674: "<tts_text_bos_single>",
    tc.AUDIO_TOKEN_ID: "<|audio_pad|>",
}
# What transformers' Qwen3OmniMoeProcessor reads off the tokenizer (tokenizer.audio_token, ...).
PROCESSOR_TOKENS = {
    "audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
}

# Whisper's features (128 bins, 16 kHz) and Qwen2-VL's image processing with Qwen3's 16-pixel
# patches (merged 2 x 2: 32 pixels a vision token side), one file for both, as published.
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "chunk_length": 300,
    "dither": 0.0,
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "hop_length": 160,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_pixels": 12845056,
    "merge_size": 2,
    "min_pixels": 3136,
    "n_fft": 400,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "patch_size": 16,
    "processor_class": "Qwen3OmniMoeProcessor",
    "return_attention_mask": True,
    "sampling_rate": 16000,
    "temporal_patch_size": 2,
}


def chat_template() -> str:
    """Qwen3-Omni's chat template: text, audio, image and video parts; tools and tool turns."""
    return resources.files(__package__).joinpath("chat_template.jinja").read_text()


def build_tiny_checkpoint(staging: Path, tokenizer_gguf: Path) -> dict[str, Any]:
    """Write the checkpoint into ``staging``; the tokenizer comes from ``tokenizer_gguf``'s metadata.

    Returns a summary (parameter counts by sub-model) for the progress line.
    """
    import torch
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    config = Qwen3OmniMoeConfig(**tc.tiny_config_kwargs())
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen3OmniMoeForConditionalGeneration(config).eval()
        init_talker_experts(model.talker, config.talker_config.text_config.initializer_range)
        torch.manual_seed(VOCODER_SEED)  # its own seed: the vocoder's draw stays when a sub-model resizes
        audible_vocoder(model.code2wav)
    model.save_pretrained(str(staging))
    write_qwen2_tokenizer(staging, tokenizer_gguf, names=OMNI_TOKEN_NAMES, processor_tokens=PROCESSOR_TOKENS,
                          chat_template=chat_template())
    write_json(staging / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    write_json(staging / "chat_template.json", {"chat_template": chat_template()})
    return {part: sum(p.numel() for p in getattr(model, part).parameters())
            for part in ("thinker", "talker", "code2wav")}


def init_talker_experts(talker: Any, std: float) -> None:
    """Draw the talker's expert weights (normal, ``std``), as its other linear layers are drawn.

    transformers 5.19 holds the talker's experts as fused ``[experts, out, in]`` parameters that its
    weight init skips: they kept whatever memory ``torch.empty`` handed them (denormals, zeros,
    1e37), so two builds differed and the talker's MoE computed garbage. (The thinker's experts
    are drawn by the init.)
    """
    import torch

    for name, parameter in talker.named_parameters():
        if ".experts." in f".{name}" and parameter.ndim == 3:
            with torch.no_grad():
                parameter.normal_(0.0, std)


def audible_vocoder(code2wav: Any) -> None:
    """Re-draw code2wav's convolutions variance-preserving (std 1/sqrt(fan_in)), the output one with a
    small gain: at transformers' init the tiny vocoder is near silent, and a waveform check against
    silence passes whatever the code does; the gain keeps the samples off the final clamp."""
    import torch

    convs = [(name, module) for name, module in code2wav.named_modules()
             if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d))]
    last = convs[-1][0] if convs else None
    for name, module in convs:
        weight = module.weight
        fan_in = weight.shape[1] * weight.shape[2] if isinstance(module, torch.nn.Conv1d) else (
            weight.shape[0] * weight.shape[2])
        with torch.no_grad():
            weight.normal_(0.0, (OUTPUT_CONV_GAIN if name == last else 1.0) / math.sqrt(fan_in))
            if module.bias is not None:
                module.bias.zero_()
