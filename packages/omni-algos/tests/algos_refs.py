"""Independent reference computations for the tests (written without omni_algos)."""

from __future__ import annotations

import math

import torch


def ref_flow_grpo_sde(x, v, sigma, sigma_next, eta, prev, sigma_max):
    """Flow-GRPO's SDE step for one row, written from the paper's equations in float64."""
    x, v, prev = x.double(), v.double(), prev.double()
    sp = sigma_max if sigma == 1 else sigma
    s = eta * math.sqrt(sigma / (1 - sp))
    dt = sigma_next - sigma
    mean = x * (1 + s**2 / (2 * sigma) * dt) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
    std = s * math.sqrt(-dt)
    lp = torch.distributions.Normal(mean, std).log_prob(prev).mean()
    return mean, lp, s


def ref_cps(x, v, sigma, sigma_next, eta, prev):
    x, v, prev = x.double(), v.double(), prev.double()
    s = sigma_next * math.sin(eta * math.pi / 2)
    x0 = x - sigma * v
    eps = x + (1 - sigma) * v
    mean = x0 * (1 - sigma_next) + eps * math.sqrt(sigma_next**2 - s**2)
    lp = -((prev - mean) ** 2).mean()
    return mean, lp, s


def ref_dance(x, v, sigma, sigma_next, eta, prev):
    x, v, prev = x.double(), v.double(), prev.double()
    dt = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - x0 * (1 - sigma)) / sigma**2
    mean = x + dt * v - 0.5 * eta**2 * score * dt
    s = eta * math.sqrt(sigma - sigma_next)
    lp = torch.distributions.Normal(mean, s).log_prob(prev).mean()
    return mean, lp, s
