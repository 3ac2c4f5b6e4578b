"""token2wav's DiT sampled from a given starting noise, for a batch of windows.

transformers' ``Qwen2_5OmniToken2WavDiTModel.sample`` draws its noise inside (one request, the
whole of it); streaming needs each window's frames to start from the noise the whole would give
them, and batching needs several windows at once. ``sample_mel`` is the same ODE (transformers'
own RK4 solver, time grid and guidance) from ``noise``.

Its velocity field is ``DiTVelocity``: transformers' DiT forward with what does not change over the
ODE's 36 evaluations computed once (``DiTVelocity.__init__``) instead of at each: the code and
speaker embeddings, the speaker encoder (ECAPA-TDNN, ~20 convolutions: half of the forward on the
tiny checkpoint), their share of the input projection, the rotary tables and the block masks (additive, one per layout); and,
per distinct time (RK4 asks for three a step), the time embedding and every layer's modulation.
What is left per evaluation is the states' projection and the transformer layers. The result
equals transformers' forward within float error (the input projection is summed in two parts).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class DiTVelocity:
    """The guided velocity of the DiT at ``(time, states)`` for one batch of windows (the ODE's function)."""

    def __init__(self, dit: Any, conditioning: torch.Tensor, reference_mel: torch.Tensor, codes: torch.Tensor,
                 guidance_scale: float) -> None:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            apply_rotary_pos_emb,
            deinterleave_head_dim,
        )

        self.rotate, self.deinterleave = apply_rotary_pos_emb, deinterleave_head_dim
        self.dit, self.guidance_scale = dit, guidance_scale
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
        self.rows = self.fixed.shape[0]
        positions = torch.arange(frames, device=self.fixed.device)[None].repeat(self.rows, 1)
        self.cos, self.sin = dit.rotary_embed(self.fixed, positions)
        # Additive masks, one per (look back, look ahead) and shared by every row and head (SDPA
        # broadcasts): a boolean mask is turned into this inside SDPA at every call (two `where`s a
        # layer an evaluation, ~10% of the ODE on a batch of 8), and transformers' copy per row and
        # head would grow with the batch and the square of its frames.
        block_diff = dit._create_block_diff(self.fixed)[:1, :1]
        masks: dict[tuple[float, float], torch.Tensor] = {}
        self.masks = [masks.setdefault((layer.look_backward_block, layer.look_ahead_block),
                                       additive_mask(block_diff, layer.look_backward_block, layer.look_ahead_block))
                      for layer in dit.transformer_blocks]
        self._by_time: dict[float, tuple[list[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]] = {}

    def modulation(self, time_step: torch.Tensor) -> tuple[list[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
        """Every layer's (shift, scale, gate) x 2 and the final norm's (scale, shift) at ``time_step``."""
        key = float(time_step)
        terms = self._by_time.get(key)
        if terms is None:
            dit = self.dit
            embedded = F.silu(dit.time_embed(time_step.reshape(()).repeat(self.rows)))
            layers = [torch.chunk(layer.attn_norm.linear(embedded), 6, dim=1) for layer in dit.transformer_blocks]
            terms = self._by_time[key] = (layers, torch.chunk(dit.norm_out.linear(embedded), 2, dim=1))
        return terms

    def attention(self, attn: Any, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """transformers' ``DiTAttention`` (rotary on the first head only, as the checkpoint was trained)."""
        rows, heads = hidden.shape[0], attn.heads
        query, key, value = (proj(hidden).view(rows, -1, heads, attn.inner_dim // heads).transpose(1, 2)
                             for proj in (attn.to_q, attn.to_k, attn.to_v))
        query[:, :1], key[:, :1] = self.rotate(self.deinterleave(query[:, :1]), self.deinterleave(key[:, :1]),
                                               self.cos, self.sin)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        return attn.to_out[0](out.transpose(1, 2).reshape(rows, -1, attn.inner_dim))

    def __call__(self, time_step: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        dit = self.dit
        layers, (scale, shift) = self.modulation(time_step)
        hidden = F.linear(torch.cat([states, states], dim=0) if self.guided else states, self.states_weight)
        hidden = hidden + self.fixed
        for layer, terms, mask in zip(dit.transformer_blocks, layers, self.masks):
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = terms
            norm = layer.attn_norm.norm(hidden) * (1 + scale_msa[:, None]) + shift_msa[:, None]
            hidden = hidden + gate_msa.unsqueeze(1) * self.attention(layer.attn, norm, mask)
            norm = layer.ff_norm(hidden) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
            hidden = hidden + gate_mlp.unsqueeze(1) * layer.ff(norm)
        output = dit.proj_out(dit.norm_out.norm(hidden) * (1 + scale)[:, None, :] + shift[:, None, :])
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
