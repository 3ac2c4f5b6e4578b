"""token2wav's DiT sampled from a given starting noise, for a batch of windows.

transformers' ``Qwen2_5OmniToken2WavDiTModel.sample`` draws its noise inside (one request, the
whole of it); streaming needs each window's frames to start from the noise the whole would give
them, and batching needs several windows at once. ``sample_mel`` is the same ODE (transformers'
own RK4 solver, time grid and guidance) from ``noise``.

Its velocity field is ``DiTVelocity``: transformers' DiT forward with what does not change over the
ODE's 36 evaluations computed once (``DiTVelocity.__init__``) instead of at each: the code and
speaker embeddings, the speaker encoder (ECAPA-TDNN, ~20 convolutions: half of the forward on the
tiny checkpoint), their share of the input projection, the rotary tables and the block masks
(additive, one per layout); and, per distinct time (RK4 asks for three a step), the time embedding
and every layer's modulation. What is left per evaluation is the states' projection and the
transformer layers, whose q, k and v are one projection with the first head's rotary folded in
(``DiTLayer``). The result
equals transformers' forward within float error (the input projection is summed in two parts).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F


class DiTLayer:
    """One decoder layer's weights as ``DiTVelocity`` uses them, built once per model (``dit_layers``).

    q, k and v are one projection, and the first head's rotary is folded into it: transformers
    deinterleaves that head's q and k (a fixed permutation of their columns) and rotates them,
    ``x * cos + rotate_half(x) * sin``, where ``rotate_half`` is a fixed signed permutation too. So
    the projection also gives that head's q and k with both permutations applied to its weight
    rows, and the rotation is two products and a sum (about 20 fewer ops a layer an evaluation: the
    ODE on one window is bound by the number of ops, not their size)."""

    def __init__(self, layer: Any) -> None:
        attn = layer.attn
        self.heads, self.inner = attn.heads, attn.inner_dim
        head = self.inner // self.heads
        deinterleave = torch.cat([torch.arange(0, head, 2), torch.arange(1, head, 2)])
        half = head // 2
        rotate = torch.cat([torch.arange(half, head), torch.arange(0, half)])  # rotate_half's source columns
        sign = torch.cat([-torch.ones(half), torch.ones(half)])[:, None]
        weights, biases = [], []
        for proj in (attn.to_q, attn.to_k):
            first_w, first_b = proj.weight[:head][deinterleave], proj.bias[:head][deinterleave]
            weights += [first_w, first_w[rotate] * sign, proj.weight[head:]]
            biases += [first_b, first_b[rotate] * sign[:, 0], proj.bias[head:]]
        weights.append(attn.to_v.weight)
        biases.append(attn.to_v.bias)
        self.qkv_weight, self.qkv_bias = torch.cat(weights).contiguous(), torch.cat(biases).contiguous()
        rest = self.inner - head
        self.split = [head, head, rest, head, head, rest, self.inner]
        self.out, self.ff_in, self.ff_out = attn.to_out[0], layer.ff.ff[0], layer.ff.ff[3]
        self.norm_eps = (layer.attn_norm.norm.eps, layer.ff_norm.eps)
        self.modulation, self.look = layer.attn_norm.linear, (layer.look_backward_block, layer.look_ahead_block)


_LAYERS: weakref.WeakKeyDictionary[Any, list[DiTLayer]] = weakref.WeakKeyDictionary()


def dit_layers(dit: Any) -> list[DiTLayer]:
    """The DiT's layers as ``DiTLayer``s, built at the first call for a model and kept with it."""
    layers = _LAYERS.get(dit)
    if layers is None:
        with torch.no_grad():
            layers = _LAYERS[dit] = [DiTLayer(layer) for layer in dit.transformer_blocks]
    return layers


class DiTVelocity:
    """The guided velocity of the DiT at ``(time, states)`` for one batch of windows (the ODE's function)."""

    def __init__(self, dit: Any, conditioning: torch.Tensor, reference_mel: torch.Tensor, codes: torch.Tensor,
                 guidance_scale: float) -> None:
        self.dit, self.guidance_scale = dit, guidance_scale
        self.layers = dit_layers(dit)
        self.guided = guidance_scale >= 1e-5  # transformers' threshold for classifier-free guidance
        frames = codes.shape[1] * dit.repeats
        speaker = conditioning.unsqueeze(1).repeat(1, frames, 1)
        code = dit.text_embed(codes, drop_code=False)
        reference = reference_mel
        if self.guided:  # the unconditioned half: no code, no speaker, no reference (transformers' apply_cfg)
            code = torch.cat([code, dit.text_embed(codes, drop_code=True)], dim=0)
            speaker = torch.cat([speaker, torch.zeros_like(speaker)], dim=0)
            reference = torch.cat([reference, torch.zeros_like(reference)], dim=0)
        embed = dit.input_embed
        encoded = embed.spk_encoder(reference).unsqueeze(1).repeat(1, frames, 1)
        weight = embed.proj.weight
        self.states_weight = weight[:, :dit.mel_dim]  # input_embed.proj of cat(states, encoded, code, speaker)
        self.fixed = F.linear(torch.cat((encoded, code, speaker), dim=-1), weight[:, dit.mel_dim:], embed.proj.bias)
        self.rows, self.frames = self.fixed.shape[0], frames
        positions = torch.arange(frames, device=self.fixed.device)[None]
        self.cos, self.sin = dit.rotary_embed(self.fixed, positions)  # [1, frames, head]: every row's
        # Additive masks, one per (look back, look ahead) and shared by every row and head (SDPA
        # broadcasts): a boolean mask is turned into this inside SDPA at every call (two `where`s a
        # layer an evaluation, ~10% of the ODE on a batch of 8), and transformers' copy per row and
        # head would grow with the batch and the square of its frames.
        block_diff = dit._create_block_diff(self.fixed)[:1, :1]
        masks: dict[tuple[float, float], torch.Tensor] = {}
        self.masks = [masks.setdefault(layer.look, additive_mask(block_diff, *layer.look)) for layer in self.layers]
        self.hidden_size = self.fixed.shape[-1]
        self._by_time: dict[float, tuple[list[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]] = {}

    def modulation(self, time_step: torch.Tensor) -> tuple[list[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
        """At ``time_step``: every layer's (shift, 1 + scale, gate) for attention and for the MLP, and the
        final norm's (1 + scale, shift), each ``[rows, 1, hidden]`` to broadcast over the frames."""
        key = float(time_step)
        terms = self._by_time.get(key)
        if terms is None:
            dit = self.dit
            embedded = F.silu(dit.time_embed(time_step.reshape(()).repeat(self.rows)))
            layers = []
            for layer in self.layers:
                shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = (
                    t[:, None] for t in torch.chunk(layer.modulation(embedded), 6, dim=1))
                layers.append((shift, 1 + scale, gate, shift_mlp, 1 + scale_mlp, gate_mlp))
            scale, shift = (t[:, None] for t in torch.chunk(dit.norm_out.linear(embedded), 2, dim=1))
            terms = self._by_time[key] = (layers, (1 + scale, shift))
        return terms

    def attention(self, layer: DiTLayer, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """transformers' ``DiTAttention`` (rotary on the first head only, as the checkpoint was trained)."""
        rows, frames, heads = hidden.shape[0], self.frames, layer.heads
        q_first, q_turned, q_rest, k_first, k_turned, k_rest, value = torch.split(
            F.linear(hidden, layer.qkv_weight, layer.qkv_bias), layer.split, dim=-1)
        query = torch.cat([q_first * self.cos + q_turned * self.sin, q_rest], dim=-1)
        key = torch.cat([k_first * self.cos + k_turned * self.sin, k_rest], dim=-1)
        query, key, value = (t.reshape(rows, frames, heads, -1).transpose(1, 2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        return layer.out(out.transpose(1, 2).reshape(rows, frames, layer.inner))

    def __call__(self, time_step: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        dit, width = self.dit, (self.hidden_size,)
        layers, (scale, shift) = self.modulation(time_step)
        hidden = F.linear(torch.cat([states, states], dim=0) if self.guided else states, self.states_weight)
        hidden = hidden + self.fixed
        for layer, terms, mask in zip(self.layers, layers, self.masks):
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = terms
            attn_eps, ff_eps = layer.norm_eps
            norm = torch.addcmul(shift_msa, F.layer_norm(hidden, width, eps=attn_eps), scale_msa)
            hidden = torch.addcmul(hidden, gate_msa, self.attention(layer, norm, mask))
            norm = torch.addcmul(shift_mlp, F.layer_norm(hidden, width, eps=ff_eps), scale_mlp)
            inner = F.gelu(layer.ff_in(norm), approximate="tanh")
            hidden = torch.addcmul(hidden, gate_mlp, layer.ff_out(inner))
        output = dit.proj_out(torch.addcmul(shift, F.layer_norm(hidden, width, eps=dit.norm_out.norm.eps), scale))
        if not self.guided:
            return output
        guided, null = torch.chunk(output, 2, dim=0)
        return guided + (guided - null) * self.guidance_scale


def additive_mask(block_diff: torch.Tensor, back: float, ahead: float) -> torch.Tensor:
    """0 where a frame's block may attend the other's (``back`` blocks before to ``ahead`` after), else -inf."""
    allowed = (block_diff >= -float(back)) & (block_diff <= float(ahead))
    return torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))


def sample_mel(dit: Any, conditioning: torch.Tensor, reference_mel: torch.Tensor, codes: torch.Tensor,
               noise: torch.Tensor, num_steps: int = 10, guidance_scale: float = 0.5,
               sway_coefficient: float | None = -1.0) -> torch.Tensor:
    """Mel spectrograms ``[B, mel_dim, frames]`` for codes ``[B, n]`` from ``noise [B, n * repeats, mel_dim]``
    (speakers: ``conditioning [B, enc_emb_dim]``, ``reference_mel [B, T, mel_dim]``)."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        RungeKutta4ODESolver,
    )

    frames = codes.shape[1] * dit.repeats
    if frames > dit.config.max_position_embeddings:
        raise ValueError(f"{codes.shape[1]} codes make {frames} mel frames, more than the DiT's "
                         f"max_position_embeddings ({dit.config.max_position_embeddings})")
    velocity = DiTVelocity(dit, conditioning, reference_mel, codes, guidance_scale)
    time_grid = torch.linspace(0, 1, num_steps, dtype=conditioning.dtype)
    if sway_coefficient is not None:
        time_grid += sway_coefficient * (torch.cos(torch.pi / 2 * time_grid) - 1 + time_grid)
    trajectory = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(time_grid)
    return trajectory[-1].permute(0, 2, 1)
