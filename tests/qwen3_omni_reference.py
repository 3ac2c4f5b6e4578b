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


def reference_speech(reference, kind, voice, thinker_tokens, talker_tokens, talker_min_tokens=0):
    """transformers' whole ``generate`` (greedy thinker and talker; the code predictor greedy with
    them, as transformers 5.19 mirrors the talker's do_sample) on a prompt of ``PROMPTS`` (``kind``)
    or a ``(text, data)`` pair: the codes it hands code2wav ``[G, frames]``, and its waveform.
    ``talker_min_tokens``: the talker's stop token held back that long (vLLM's ``min_tokens``)."""
    model, processor = reference
    text, data = PROMPTS[kind] if isinstance(kind, str) else kind
    inputs = processor(text=text, audio=[data["audio"][0]] if "audio" in data else None,
                       images=[data["image"]] if "image" in data else None, return_tensors="pt")
    captured = {}
    decode = model.code2wav.chunked_decode

    def capture(codes, **kwargs):
        captured["codes"] = codes.clone()
        return decode(codes, **kwargs)

    model.code2wav.chunked_decode = capture
    try:
        with torch.no_grad():
            _, wav = model.generate(**inputs, speaker=voice, thinker_max_new_tokens=thinker_tokens,
                                    thinker_do_sample=False, talker_max_new_tokens=talker_tokens,
                                    talker_min_new_tokens=talker_min_tokens, talker_do_sample=False)
    finally:
        model.code2wav.chunked_decode = decode
    return captured["codes"][0].numpy(), wav.reshape(-1).numpy()
