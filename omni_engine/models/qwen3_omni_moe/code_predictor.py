"""Qwen3-Omni's code predictor: the rest of a frame's code groups from the talker's first code.

For each frame the talker makes code 0; the predictor, a small dense Qwen3 decoder, makes codes
1 .. G-1 from ``[the talker's hidden state that made code 0, code 0's talker embedding]``, one code
per step, each step's code embedded (its group's own embedding) and appended. The decoder's
modules are transformers' own (the same weights, the same arithmetic as the reference), run as
transformers' ``generate`` runs them: a prefill of the two rows, then one row a step against a KV
cache, batched across the frames of every request in the forward. Not transformers' model
``forward``: its mask building and output plumbing cost more than the tiny decoder's arithmetic
(half the tiny talker's CPU a frame, without a cache recomputing every row at every step, as
vLLM-Omni runs it); the published predictor makes 15 codes a frame. Greedy where the talker is greedy (as
transformers mirrors the talker's ``do_sample``), else top-k 50 / top-p 0.8 at temperature 1
(transformers' ``generate`` defaults for it), with the request's own generator where it has a seed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
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
    model = predictor.model
    groups = len(predictor.lm_head)
    rows = [first_embeds.unsqueeze(1)]
    step_input = torch.stack([hidden, first_embeds], dim=1)
    # rotary tables for every position a frame reaches: 0, 1 (the prefill), then one a step
    cos, sin = model.rotary_emb(step_input, torch.arange(groups + 1, device=hidden.device).unsqueeze(0))
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    codes = []
    start = 0
    for step in range(groups):
        end = start + step_input.shape[1]
        last = decoder_rows(model, step_input, cos[:, start:end], sin[:, start:end], cache)
        logits = predictor.lm_head[step](model.norm(last))
        codes.append(pick_codes(logits, samplers))
        rows.append(model.codec_embedding[step](codes[-1]).unsqueeze(1))
        step_input, start = rows[-1], end
    summed = torch.cat(rows, dim=1).sum(1)
    return torch.stack(codes, dim=1), summed


def decoder_rows(model: nn.Module, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The predictor's decoder layers over ``rows`` ``[B, T, D]`` (the next positions after what
    ``cache`` holds, which grows by them); the last row's hidden state ``[B, D]``, before the norm.
    Each layer as transformers' decoder layer computes it (its own norms, projections and MLP;
    SDPA, causal over a prefill, the one new row against the cache after)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb, repeat_kv

    batch, length, _ = rows.shape
    hidden = rows
    for index, layer in enumerate(model.layers):
        attn = layer.self_attn
        shape = (batch, length, -1, attn.head_dim)
        normed = layer.input_layernorm(hidden)
        query = attn.q_norm(attn.q_proj(normed).view(shape)).transpose(1, 2)
        key = attn.k_norm(attn.k_proj(normed).view(shape)).transpose(1, 2)
        value = attn.v_proj(normed).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if index < len(cache):
            key, value = (torch.cat([cache[index][0], key], dim=2), torch.cat([cache[index][1], value], dim=2))
            cache[index] = (key, value)
        else:
            cache.append((key, value))
        out = F.scaled_dot_product_attention(query, repeat_kv(key, attn.num_key_value_groups),
                                             repeat_kv(value, attn.num_key_value_groups),
                                             is_causal=length > 1, scale=attn.scaling)
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden[:, -1]


def pick_codes(logits: torch.Tensor, samplers: list[torch.Generator | None | bool]) -> torch.Tensor:
    """Each frame's code from its ``logits`` row: the greedy ones in one argmax, the others drawn."""
    codes = logits.argmax(dim=-1)
    for row, sampler in enumerate(samplers):
        if sampler is not False:
            codes[row] = sample_top_k_top_p(logits[row], sampler)
    return codes
