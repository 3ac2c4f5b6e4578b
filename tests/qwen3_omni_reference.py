"""transformers' Qwen3-Omni-MoE on the tiny checkpoint, as the reference its stages are checked
against: the prompts (Qwen3-Omni's placeholders), and the whole model."""

from __future__ import annotations

import torch

from tests.qwen_omni_reference import image, tone


def load_reference(model_dir):
    """transformers' whole model (float32, eval) and our processor of the checkpoint."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omni_engine.models.qwen3_omni_moe.processor import load_processor

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, load_processor(model_dir)


def chat(user: str, system: str | None = None) -> str:
    """One user turn as Qwen3-Omni's template renders it (no default system turn)."""
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = {
    "text": (chat("What is the capital of France?"), {}),
    "audio": (chat("<|audio_start|><|audio_pad|><|audio_end|>What did you hear?"), {"audio": (tone(), 16000)}),
    "image": (chat("<|vision_start|><|image_pad|><|vision_end|>Describe it."), {"image": image()}),
}
