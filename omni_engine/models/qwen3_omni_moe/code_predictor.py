"""Qwen3-Omni's code predictor: the rest of a frame's code groups from the talker's first code.

For each frame the talker makes code 0; the predictor, a small dense Qwen3 decoder, makes codes
1 .. G-1 from ``[the talker's hidden state that made code 0, code 0's talker embedding]``, one code
per step, each step's code embedded (its group's own embedding) and appended. It runs as
transformers' ``generate`` runs it, on transformers' module's weights: a prefill of the two rows,
then one row a step against a KV cache, batched across the frames of every request in the forward.
Not through transformers' model ``forward``: its mask building and output plumbing cost more than
the tiny decoder's arithmetic (without a cache, every row recomputed at every step, as vLLM-Omni
runs it, it was half the tiny talker's CPU a frame; the published predictor makes 15 codes a
frame). Each layer's q, k and v are one matmul, its MLP's gate and up one (``fuse_projections``);
the norms, rotary and attention are transformers' arithmetic, op for op. Greedy where the talker is greedy (as
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
    Each layer computes what transformers' decoder layer does (SDPA, causal over a prefill, the one
    new row against the cache after)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import rotate_half

    batch, length, _ = rows.shape
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # over the heads
    hidden = rows
    for index, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv_weight, qkv_bias = fused_weight(attn, (attn.q_proj, attn.k_proj, attn.v_proj))
        qkv = F.linear(rms_norm(hidden, layer.input_layernorm), qkv_weight, qkv_bias)
        query, key, value = qkv.split([attn.q_proj.out_features, attn.k_proj.out_features,
                                       attn.v_proj.out_features], dim=-1)
        shape = (batch, length, -1, attn.head_dim)
        query = rms_norm(query.view(shape), attn.q_norm).transpose(1, 2)
        key = rms_norm(key.view(shape), attn.k_norm).transpose(1, 2)
        value = value.view(shape).transpose(1, 2)
        query, key = query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin
        if index < len(cache):
            key, value = (torch.cat([cache[index][0], key], dim=2), torch.cat([cache[index][1], value], dim=2))
            cache[index] = (key, value)
        else:
            cache.append((key, value))
        out = F.scaled_dot_product_attention(query, key, value, is_causal=length > 1, scale=attn.scaling,
                                             enable_gqa=attn.num_key_value_groups > 1)
        out_proj, down_proj = attn.o_proj, mlp.down_proj
        hidden = hidden + F.linear(out.transpose(1, 2).reshape(batch, length, -1), out_proj.weight, out_proj.bias)
        gate_up_weight, gate_up_bias = fused_weight(mlp, (mlp.gate_proj, mlp.up_proj))
        gate, up = F.linear(rms_norm(hidden, layer.post_attention_layernorm), gate_up_weight,
                            gate_up_bias).chunk(2, dim=-1)
        hidden = hidden + F.linear(mlp.act_fn(gate) * up, down_proj.weight, down_proj.bias)
    return hidden[:, -1]


def rms_norm(hidden: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' ``Qwen3OmniMoeRMSNorm`` forward, op for op, without the module call."""
    dtype = hidden.dtype
    if dtype != torch.float32:  # (a no-op call otherwise, on the predictor's every row and head)
        hidden = hidden.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * (hidden if dtype == torch.float32 else hidden.to(dtype))


def fused_weight(owner: nn.Module, linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears``, kept on ``owner``: made once, the linears' own weights
    becoming views of it, so a weight later loaded into them in place (``load_state_dict``) is the
    fused one's too. Made again if a linear's weight is no longer such a view (a dtype or device
    move, a load that assigned new tensors)."""
    fused = owner.__dict__.get("fused_projection")
    first = linears[0].weight
    if fused is None or fused[0].data_ptr() != first.data_ptr() or fused[0].dtype != first.dtype:
        fused = (fuse_into_views(linears, "weight"),
                 fuse_into_views(linears, "bias") if linears[0].bias is not None else None)
        owner.__dict__["fused_projection"] = fused  # a plain attribute: not a parameter or buffer
    return fused


def fuse_into_views(linears: tuple[nn.Linear, ...], name: str) -> torch.Tensor:
    """``linears``' ``name`` tensors stacked into one, each linear's now a view of its rows."""
    fused = torch.cat([getattr(linear, name).detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = getattr(linear, name).shape[0]
        setattr(linear, name, nn.Parameter(fused[start:start + rows], requires_grad=False))
        start += rows
    return fused


def pick_codes(logits: torch.Tensor, samplers: list[torch.Generator | None | bool]) -> torch.Tensor:
    """Each frame's code from its ``logits`` row: the greedy ones in one argmax, the others drawn."""
    codes = logits.argmax(dim=-1)
    for row, sampler in enumerate(samplers):
        if sampler is not False:
            codes[row] = sample_top_k_top_p(logits[row], sampler)
    return codes
