"""token2wav's DiT sampled from a given starting noise, for a batch of windows.

transformers' ``Qwen2_5OmniToken2WavDiTModel.sample`` draws its noise inside (one request, the
whole of it); streaming needs each window's frames to start from the noise the whole would give
them, and batching needs several windows at once. ``sample_mel`` is the same ODE (transformers'
own RK4 solver and DiT forward, the same time grid and guidance), from ``noise``.
"""

from __future__ import annotations

from typing import Any

import torch


class MemoizedSpeakerEncoder(torch.nn.Module):
    """The DiT runs its speaker encoder (ECAPA-TDNN, ~20 convolutions) on the same reference mels at
    every ODE evaluation (36 per rendering: half of its time on the tiny checkpoint). It is a pure
    function of them, so the last result is kept and given again for equal inputs."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        last = self._last
        if last is not None and last[0].shape == mels.shape and torch.equal(last[0], mels):
            return last[1]
        encoded = self.encoder(mels)
        self._last = (mels, encoded)
        return encoded


def memoize_speaker_encoder(dit: Any) -> None:
    if not isinstance(dit.input_embed.spk_encoder, MemoizedSpeakerEncoder):
        dit.input_embed.spk_encoder = MemoizedSpeakerEncoder(dit.input_embed.spk_encoder)


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
    conditioning = conditioning.unsqueeze(1).repeat(1, frames, 1)

    def ode_function(time_step: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        if guidance_scale < 1e-5:
            return dit(hidden_states=states, speaker_embedding=conditioning, condition_vector=reference_mel,
                       quantized_code=codes, time_step=time_step, drop_audio_conditioning=False,
                       drop_code=False, apply_cfg=False)
        output = dit(hidden_states=states, quantized_code=codes, speaker_embedding=conditioning,
                     condition_vector=reference_mel, time_step=time_step, apply_cfg=True)
        guided, null = torch.chunk(output, 2, dim=0)
        return guided + (guided - null) * guidance_scale

    time_grid = torch.linspace(0, 1, num_steps, dtype=conditioning.dtype)
    if sway_coefficient is not None:
        time_grid += sway_coefficient * (torch.cos(torch.pi / 2 * time_grid) - 1 + time_grid)
    trajectory = RungeKutta4ODESolver(function=ode_function, initial_value=noise).integrate(time_grid)
    return trajectory[-1].permute(0, 2, 1)
