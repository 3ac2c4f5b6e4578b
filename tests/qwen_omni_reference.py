"""transformers' Qwen2.5-Omni on the tiny checkpoint, as the reference the stages and the server are
checked against: the prompts, and greedy thinker ids, talker codes and token2wav's waveform."""

from __future__ import annotations

import numpy as np
import torch

MAX_TOKENS = 12


def load_reference(omni_dir):
    """transformers' whole model (float32, eval) and our processor of the checkpoint."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omni_engine.models.qwen2_5_omni.processor import load_processor

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(omni_dir), dtype=torch.float32).eval()
    return model, load_processor(omni_dir)


SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"


def chat(user: str) -> str:
    return f"{SYSTEM}{user}<|im_end|>\n<|im_start|>assistant\n"


def tone(seconds: float = 2.0, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t) * np.sin(2 * np.pi * 3 * t)).astype(np.float32)


def image():
    from PIL import Image

    return Image.fromarray((np.random.default_rng(0).random((56, 84, 3)) * 255).astype(np.uint8))


PROMPTS = {
    "text": (chat("What is the capital of France?"), {}),
    # (samples, rate): vLLM's form for audio with its rate, which the wire carries as a list
    "audio": (chat("<|audio_bos|><|AUDIO|><|audio_eos|>What did you hear?"), {"audio": (tone(), 16000)}),
    "image": (chat("<|vision_bos|><|IMAGE|><|vision_eos|>Describe it."), {"image": image()}),
}


def reference_generate(reference, kind, prompts=PROMPTS):
    """transformers' thinker, greedy, on a prompt of ``prompts`` (``kind``) or a ``(text, data)`` pair
    (either family's: their thinkers generate alike)."""
    model, processor = reference
    text, data = prompts[kind] if isinstance(kind, str) else kind
    inputs = processor(text=text, audio=[data["audio"][0]] if "audio" in data else None,
                       images=[data["image"]] if "image" in data else None, return_tensors="pt")
    with torch.no_grad():
        out = model.thinker.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                                     output_hidden_states=True, return_dict_in_generate=True)
    return inputs, out


def reference_run(reference, kind, prompts=PROMPTS):
    """transformers' greedy ids and, per step, the chosen token's logprob and the top-2 gap."""
    inputs, out = reference_generate(reference, kind, prompts)
    ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs, gaps = [], []
    for token, logits in zip(ids, out.logits):
        lp = torch.log_softmax(logits[0].double(), dim=-1)
        top2 = torch.topk(lp, 2).values
        logprobs.append(float(lp[token]))
        gaps.append(float(top2[0] - top2[1]))
    return ids, logprobs, gaps


TALKER_TOKENS = 30


def reference_codes(reference, kind, voice="Chelsie"):
    """transformers' talker, greedy, as its ``generate(return_audio=True)`` sets it up (inputs built
    from the thinker's states exactly so), stepped by this loop with its forward.

    Not its ``generate`` itself: transformers 5.19's talker ``generate`` calls the forward without
    the attention mask, so the forward's prefill branch never runs and the codec pad and codec bos
    embeddings are never added to the last two prompt rows, as Qwen's code (and vLLM-Omni) add them
    and as the forward itself is written to (measured: those two rows then differ by exactly those
    embeddings). Here the forward gets the mask, as the model's code intends.
    """
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    model = reference[0]
    inputs, out = reference_generate(reference, kind)
    talker, embed = model.talker, model.thinker.get_input_embeddings()
    ids, length = inputs["input_ids"], inputs["input_ids"].shape[1]
    embeds = torch.cat([step[0] for step in out.hidden_states], dim=1)
    hidden = torch.cat([step[-1] for step in out.hidden_states], dim=1)
    generated = out.sequences[:, length:]
    bos = torch.tensor([[model.speaker_map[voice]["bos_token"]]])
    prompt_embeds = embeds[:, :length].clone()
    if "input_features" in inputs:  # transformers zeroes the merged audio features
        prompt_embeds[ids == model.config.thinker_config.audio_token_index] = 0
    reply = hidden[:, length:] + embeds[:, length:]
    prefill = torch.cat([hidden[:, :length] + prompt_embeds, embed(bos), reply[:, :1]], dim=1)
    reply = torch.cat([reply[:, 1:], embed(torch.tensor([[talker.text_eos_token]])),
                       embed(torch.tensor([[talker.text_pad_token]]))], dim=1)
    history = torch.cat([torch.full_like(ids, talker.codec_mask_token),
                         torch.tensor([[talker.codec_pad_token, talker.codec_bos_token]])], dim=1)
    penalty = RepetitionPenaltyLogitsProcessor(1.05)
    talker.rope_deltas = None
    codes, cache = [], None
    with torch.no_grad():
        # what generate hands its talker for the rope: the image grid, the audio's feature lengths
        rope_inputs = {"image_grid_thw": inputs.get("image_grid_thw")}
        if "feature_attention_mask" in inputs:
            rope_inputs["audio_feature_lengths"] = inputs["feature_attention_mask"].sum(dim=1)
        step = talker(inputs_embeds=prefill, attention_mask=torch.ones_like(history),
                      input_text_ids=torch.cat([ids, bos, generated[:, :1]], dim=1), use_cache=True, **rope_inputs)
        for _ in range(TALKER_TOKENS):
            scores = penalty(history, step.logits[:, -1].clone())
            scores[:, talker.codec_bos_token] = -float("inf")
            code = int(scores.argmax())
            codes.append(code)
            if code in (talker.codec_pad_token, talker.codec_eos_token):
                codes.pop()
                break
            history = torch.cat([history, torch.tensor([[code]])], dim=1)
            cache = step.past_key_values
            step = talker(input_ids=torch.tensor([[code]]), attention_mask=torch.ones_like(history),
                          past_key_values=cache, thinker_reply_part=reply[:, :1], use_cache=True)
            if reply.shape[1] > 1:
                reply = reply[:, 1:]
    return codes


def reference_wav(reference, codes, voice="Chelsie", seed=0):
    """transformers' token2wav on ``codes`` with the noise of ``torch.manual_seed(seed)``."""
    model, _ = reference
    speaker = model.speaker_map[voice]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        wav = model.token2wav(torch.tensor([codes]), conditioning=speaker["cond"].float()[None],
                              reference_mel=speaker["ref_mel"].float())
    return wav.reshape(-1).numpy()
