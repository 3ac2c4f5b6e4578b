"""Mixing two next-token distributions: log q ∝ (1-α)·log π_θ + α·log π_t.

``kl_symmetry`` picks, per row, the α in [0, 1] where KL(q‖π_θ) = KL(q‖π_t). With
d = log π_t - log π_θ, the difference of the two KLs is E_q[d] (the log q terms
cancel), which grows with α (its derivative is Var_q(d) ≥ 0): zero or negative at
α = 0 (q = π_θ), zero or positive at α = 1, so the root is bracketed in [0, 1].

The solver is safeguarded Newton: Var_q(d), the slope, comes from the same softmax as
E_q[d]; a Newton step that would leave the bracket is replaced by a false-position step
(Illinois variant, so one stuck end cannot stall it), and that by a halving. Each row
stops on its own once its step is below ``ALPHA_TOLERANCE`` and leaves the batch, so the
rest iterate on fewer rows. On SmolLM2's rows (teacher with, theta without a reference
answer; batches of 8 x 49152, float32, 2 cores): 2-6 steps per row, 6.6 ms per batch
(median), against 24 softmaxes and 16.2 ms for plain bisection.
"""

from __future__ import annotations

import torch

from omni_engine.logits.mixing_wiring import ALPHA_METHODS  # noqa: F401
# A masked token (-inf) would make d infinite or NaN: floor log-probs here instead.
LOGPROB_FLOOR = -1e4
# 100x below the 1e-4 the method is held to, and about float32's noise in E_q[d] near the root.
ALPHA_TOLERANCE = 1e-6
MAX_SOLVER_STEPS = 40  # halving alone is done in 20 (2**-20 < 1e-6)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).clamp_min(LOGPROB_FLOOR)


def mix(log_theta: torch.Tensor, log_teacher: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """log q, normalized, for each row (``alpha``: one value per row)."""
    a = alpha.to(log_theta.dtype).unsqueeze(-1)
    return torch.log_softmax((1 - a) * log_theta + a * log_teacher, dim=-1)


def kl_symmetry_alpha(log_theta: torch.Tensor, log_teacher: torch.Tensor) -> torch.Tensor:
    """Per row, the α in [0, 1] with KL(q‖π_θ) = KL(q‖π_t) (see the module docstring)."""
    d = log_teacher - log_theta
    rows = log_theta.shape[0]
    alpha = torch.empty(rows, dtype=log_theta.dtype, device=log_theta.device)
    # The bracket and E_q[d] at its ends: f(0) = -KL(π_θ‖π_t), f(1) = KL(π_t‖π_θ), no softmax needed.
    lo, hi = torch.zeros_like(alpha), torch.ones_like(alpha)
    f_lo, f_hi = (log_theta.exp() * d).sum(-1), (log_teacher.exp() * d).sum(-1)
    kept = torch.zeros_like(alpha)  # which end stayed last step: -1 low, +1 high (Illinois)
    x = _false_position(lo, hi, f_lo, f_hi)
    active = torch.arange(rows, device=log_theta.device)
    theta_rows, d_rows = log_theta, d
    for _ in range(MAX_SOLVER_STEPS):
        q = torch.softmax(torch.addcmul(theta_rows, x.unsqueeze(-1), d_rows), dim=-1)
        qd = q * d_rows
        f = qd.sum(-1)  # E_q[d] = KL(q‖π_θ) - KL(q‖π_t)
        slope = (qd * d_rows).sum(-1) - f * f  # Var_q(d) = df/dα
        below = f > 0  # the root is below x: the high end moves, the low one stays
        f_lo = torch.where(below & (kept < 0), f_lo / 2, f_lo)
        f_hi = torch.where(~below & (kept > 0), f_hi / 2, f_hi)
        kept = torch.where(below, -torch.ones_like(kept), torch.ones_like(kept))
        hi, f_hi = torch.where(below, x, hi), torch.where(below, f, f_hi)
        lo, f_lo = torch.where(below, lo, x), torch.where(below, f_lo, f)
        delta = f / slope  # Newton's step, and its estimate of x's distance to the root
        step = _inside(x - delta, lo, hi, _false_position(lo, hi, f_lo, f_hi))
        # Solved: a negligible Newton step (which may round onto an end of the bracket, so it
        # is tested before the bracket is), a collapsed bracket, or E_q[d] exactly 0
        # (identical rows: every α is a root).
        close = delta.abs() < ALPHA_TOLERANCE
        solved = close | (hi - lo < ALPHA_TOLERANCE) | (f == 0)
        x = torch.where(f == 0, x, torch.where(close, x - delta, step))
        if bool(solved.any()):
            alpha[active[solved]] = x[solved]
            left = ~solved
            if not bool(left.any()):
                return alpha
            active, x, lo, hi, f_lo, f_hi, kept = (t[left] for t in (active, x, lo, hi, f_lo, f_hi, kept))
            theta_rows, d_rows = log_theta[active], d[active]  # the unsolved rows
    alpha[active] = x
    return alpha


def _false_position(lo: torch.Tensor, hi: torch.Tensor, f_lo: torch.Tensor, f_hi: torch.Tensor) -> torch.Tensor:
    """Where the chord between the bracket's ends crosses zero; the midpoint where that is not
    strictly inside (equal ends give NaN)."""
    return _inside((lo * f_hi - hi * f_lo) / (f_hi - f_lo), lo, hi, (lo + hi) / 2)


def _inside(candidate: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``candidate`` where it lies strictly inside the bracket (never NaN), else ``fallback``."""
    return torch.where((candidate > lo) & (candidate < hi), candidate, fallback)


def choose_alpha(method: str, value: float | None, log_theta: torch.Tensor, log_teacher: torch.Tensor) -> torch.Tensor:
    if method == "fixed":
        return torch.full((log_theta.shape[0],), float(value), dtype=log_theta.dtype, device=log_theta.device)
    if method == "kl_symmetry":
        return kl_symmetry_alpha(log_theta, log_teacher)
    raise ValueError(f"unknown alpha method {method!r}; expected one of {list(ALPHA_METHODS)}")
