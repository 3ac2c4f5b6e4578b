"""Qwen3-Omni's code predictor: the rest of a frame's code groups from the talker's first code.

For each frame the talker makes code 0; the predictor, a small dense Qwen3 decoder, makes codes
1 .. G-1 from ``[the talker's hidden state that made code 0, code 0's talker embedding]``, one code
per step, each step's code embedded (its group's own embedding) and appended. The decoder is
transformers' own module (the same weights, the same arithmetic as the reference); it runs without
a KV cache, the whole short sequence (at most G + 1 rows) each step, batched across the frames of
every request in the forward, as vLLM-Omni runs it. Greedy where the talker is greedy (as
transformers mirrors the talker's ``do_sample``), else top-k 50 / top-p 0.8 at temperature 1
(transformers' ``generate`` defaults for it), with the request's own generator where it has a seed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

TOP_K = 50
TOP_P = 0.8
PREFIX = "talker.code_predictor."


def build_code_predictor(config: dict[str, Any]) -> nn.Module:
    """transformers' predictor (decoder, per-group embeddings and heads) for ``config`` (a dict)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerCodePredictorConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
    )

    predictor_config = Qwen3OmniMoeTalkerCodePredictorConfig(**config)
    predictor_config._attn_implementation = "sdpa"
    return Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(predictor_config).eval()


def sample_top_k_top_p(logits: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from ``logits`` ``[vocab]`` after top-k, then top-p (transformers' warpers' order)."""
    values, indices = torch.topk(logits.float(), min(TOP_K, logits.shape[-1]))
    probs = torch.softmax(values, dim=-1)
    cumulative = torch.cumsum(probs, dim=-1)
    keep = cumulative - probs < TOP_P  # the smallest set whose mass reaches top_p (at least one)
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    choice = torch.multinomial(probs / probs.sum(), 1, generator=generator)
    return int(indices[choice])


@torch.no_grad()
def predict_codes(predictor: nn.Module, hidden: torch.Tensor, first_embeds: torch.Tensor,
                  samplers: list[torch.Generator | None | bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes 1 .. G-1 for a batch of frames, and each frame's summed code embeddings.

    ``hidden`` ``[B, D]``: the talker's (normed) hidden state that made each frame's code 0;
    ``first_embeds`` ``[B, D]``: code 0's talker embedding; ``samplers[b]``: False for greedy, else
    the generator to draw with (None: torch's global one). Returns ``codes`` ``[B, G - 1]`` and
    ``summed`` ``[B, D]`` (code 0's embedding plus every other group's, the talker's next input).
    """
    groups = len(predictor.lm_head)
    rows = [hidden.unsqueeze(1), first_embeds.unsqueeze(1)]
    codes = []
    batch = hidden.shape[0]
    for step in range(groups):
        sequence = torch.cat(rows, dim=1)
        positions = torch.arange(sequence.shape[1], device=sequence.device).unsqueeze(0).expand(batch, -1)
        out = predictor.model(inputs_embeds=sequence, position_ids=positions, use_cache=False)
        logits = predictor.lm_head[step](out.last_hidden_state[:, -1])
        step_codes = torch.empty(batch, dtype=torch.long, device=logits.device)
        for b, sampler in enumerate(samplers):
            step_codes[b] = (int(logits[b].argmax()) if sampler is False
                             else sample_top_k_top_p(logits[b], sampler))
        codes.append(step_codes)
        rows.append(predictor.model.codec_embedding[step](step_codes).unsqueeze(1))
    summed = torch.cat(rows[1:], dim=1).sum(1)
    return torch.stack(codes, dim=1), summed
