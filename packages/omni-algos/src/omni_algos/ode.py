"""A second-order multistep ODE step for flow matching: DPM-Solver++(2M).

Used where sampling needs no log-probs and fewer denoiser calls matter, e.g. the steps after
MixGRPO's SDE window (Li et al. 2025, arXiv 2507.21802, "MixGRPO-Flash": a higher-order ODE
solver after the window).

Flow matching writes ``x_sigma = alpha x0 + sigma eps`` with ``alpha = 1 - sigma``, and the
model's velocity ``v = eps - x0`` gives the data prediction ``x0_hat = x - sigma v``. With
``lambda = log(alpha / sigma)`` and ``h = lambda_next - lambda`` (Lu et al. 2022,
"DPM-Solver++", arXiv 2211.01095, eq. (9) and Alg. 2):

- first order (DDIM): ``x_next = (sigma_next / sigma) x - alpha_next (exp(-h) - 1) x0_hat``;
  for flow matching this equals the Euler step ``x + (sigma_next - sigma) v``;
- second order (2M), with the previous step's prediction ``x0_prev`` at ``sigma_prev``,
  ``h_prev = lambda - lambda_prev`` and ``r = h_prev / h``:
  ``D = (1 + 1 / (2 r)) x0_hat - (1 / (2 r)) x0_prev``,
  ``x_next = (sigma_next / sigma) x - alpha_next (exp(-h) - 1) D``.

A step to ``sigma_next = 0`` returns ``x0_hat`` (first order at the end, as DPM-Solver++'s
``lower_order_final``). Computed in ``max(float32, input dtype)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["dpm_solver_2m_step"]


def _lam(sigma: float) -> float:
    return math.log((1.0 - sigma) / sigma)


def dpm_solver_2m_step(
    sample: Tensor,
    velocity: Tensor,
    sigma: float,
    sigma_next: float,
    *,
    x0_prev: Tensor | None = None,
    sigma_prev: float | None = None,
) -> tuple[Tensor, Tensor]:
    """One DPM-Solver++(2M) step from ``sigma`` to ``sigma_next`` (module docstring).

    Without ``x0_prev`` (the first step of a run of steps) it is the first-order step.
    Returns ``(x_next, x0_hat)``; pass ``x0_hat`` and ``sigma`` as ``x0_prev`` /
    ``sigma_prev`` to the next step."""
    if not 0.0 < sigma < 1.0:
        raise ValueError(f"sigma must be in (0, 1), got {sigma}")
    if not 0.0 <= sigma_next < sigma:
        raise ValueError(f"sigma_next must be in [0, sigma), got {sigma_next} (sigma {sigma})")
    dtype = torch.promote_types(torch.float32, sample.dtype)
    x = sample.to(dtype)
    x0 = x - sigma * velocity.to(dtype)
    if sigma_next == 0.0:
        return x0, x0
    h = _lam(sigma_next) - _lam(sigma)
    d = x0
    if x0_prev is not None:
        if sigma_prev is None or not sigma < sigma_prev < 1.0:
            raise ValueError(f"sigma_prev must be in (sigma, 1) with x0_prev, got {sigma_prev}")
        r = (_lam(sigma) - _lam(sigma_prev)) / h
        d = (1.0 + 1.0 / (2.0 * r)) * x0 - (1.0 / (2.0 * r)) * x0_prev.to(dtype)
    x_next = (sigma_next / sigma) * x - (1.0 - sigma_next) * math.expm1(-h) * d
    return x_next, x0
