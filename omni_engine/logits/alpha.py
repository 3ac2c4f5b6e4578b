"""Mixing two next-token distributions: log q ∝ (1-α)·log π_θ + α·log π_t.

``kl_symmetry`` picks, per row, the α in [0, 1] where KL(q‖π_θ) = KL(q‖π_t). With
d = log π_t - log π_θ, the difference of the two KLs is E_q[d] (the log q terms
cancel), which grows with α (its derivative is Var_q(d) ≥ 0): zero or negative at
α = 0 (q = π_θ), zero or positive at α = 1. So a vectorized bisection on E_q[d] finds it.
"""

from __future__ import annotations

import torch

from omni_engine.logits.mixing_wiring import ALPHA_METHODS  # noqa: F401
# A masked token (-inf) would make d infinite or NaN: floor log-probs here instead.
LOGPROB_FLOOR = -1e4
BISECTION_STEPS = 24  # 2**-24 < 1e-7: far below the 1e-4 the method is held to


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).clamp_min(LOGPROB_FLOOR)


def mix(log_theta: torch.Tensor, log_teacher: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """log q, normalized, for each row (``alpha``: one value per row)."""
    a = alpha.to(log_theta.dtype).unsqueeze(-1)
    return torch.log_softmax((1 - a) * log_theta + a * log_teacher, dim=-1)


def kl_symmetry_alpha(log_theta: torch.Tensor, log_teacher: torch.Tensor) -> torch.Tensor:
    """Per row, the α in [0, 1] with KL(q‖π_θ) = KL(q‖π_t) (see the module docstring)."""
    d = log_teacher - log_theta
    lo = torch.zeros(log_theta.shape[0], dtype=log_theta.dtype, device=log_theta.device)
    hi = torch.ones_like(lo)
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        q = torch.softmax(log_theta + mid.unsqueeze(-1) * d, dim=-1)
        above = (q * d).sum(-1) > 0  # E_q[d] > 0: the root is below mid
        hi = torch.where(above, mid, hi)
        lo = torch.where(above, lo, mid)
    return (lo + hi) / 2


def choose_alpha(method: str, value: float | None, log_theta: torch.Tensor, log_teacher: torch.Tensor) -> torch.Tensor:
    if method == "fixed":
        return torch.full((log_theta.shape[0],), float(value), dtype=log_theta.dtype, device=log_theta.device)
    if method == "kl_symmetry":
        return kl_symmetry_alpha(log_theta, log_teacher)
    raise ValueError(f"unknown alpha method {method!r}; expected one of {list(ALPHA_METHODS)}")
