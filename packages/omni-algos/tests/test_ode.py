"""DPM-Solver++(2M) for flow matching: first order is Euler, exact on straight flows, and
second-order convergence on a Gaussian data distribution whose exact ODE solution is known."""

import itertools
import math

import pytest
import torch

from omni_algos.ode import dpm_solver_2m_step

M, S = 0.7, 0.3  # data x0 ~ N(M, S^2), 1-D


def _var(sigma: float) -> float:
    return (1 - sigma) ** 2 * S**2 + sigma**2


def gaussian_velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """The exact flow-matching velocity E[eps - x0 | x_sigma] for x0 ~ N(M, S^2)."""
    c = x - (1 - sigma) * M
    e_x0 = M + (1 - sigma) * S**2 / _var(sigma) * c
    e_eps = sigma / _var(sigma) * c
    return e_eps - e_x0


def exact(x: torch.Tensor, s0: float, s1: float) -> torch.Tensor:
    """The probability-flow ODE keeps each point's quantile: an affine map."""
    return (1 - s1) * M + math.sqrt(_var(s1) / _var(s0)) * (x - (1 - s0) * M)


def solve(x: torch.Tensor, sigmas: list[float], order: int) -> torch.Tensor:
    x0_prev = s_prev = None
    for s, sn in itertools.pairwise(sigmas):
        v = gaussian_velocity(x, s)
        if order == 1:
            x = x + (sn - s) * v
        else:
            x, x0 = dpm_solver_2m_step(x, v, s, sn, x0_prev=x0_prev, sigma_prev=s_prev)
            x0_prev, s_prev = x0, s
    return x


def test_first_order_step_is_the_euler_step():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    nxt, x0 = dpm_solver_2m_step(x, v, 0.6, 0.45)
    torch.testing.assert_close(nxt, x + (0.45 - 0.6) * v)
    torch.testing.assert_close(x0, x - 0.6 * v)


def test_exact_on_a_straight_flow_and_at_sigma_zero():
    g = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(5, generator=g), torch.randn(5, generator=g)
    sig = [0.8, 0.6, 0.3, 0.1]
    x = (1 - sig[0]) * x0 + sig[0] * eps
    prev = s_prev = None
    for s, sn in itertools.pairwise(sig):
        x, p = dpm_solver_2m_step(x, eps - x0, s, sn, x0_prev=prev, sigma_prev=s_prev)
        prev, s_prev = p, s
        torch.testing.assert_close(x, (1 - sn) * x0 + sn * eps)
    last, _ = dpm_solver_2m_step(x, eps - x0, sig[-1], 0.0, x0_prev=prev, sigma_prev=s_prev)
    torch.testing.assert_close(last, x0)


def test_second_order_converges_faster_than_euler():
    x = torch.linspace(-2, 2, 9, dtype=torch.float64)
    s0, s1 = 0.9, 0.05
    errs = {1: [], 2: []}
    for n in (32, 64, 128):
        sig = torch.linspace(s0, s1, n + 1, dtype=torch.float64).tolist()
        for order in (1, 2):
            errs[order].append(float((solve(x, sig, order) - exact(x, s0, s1)).abs().max()))
    # halving the step: Euler's error halves, the 2M error drops about four-fold
    for order, want in ((1, 2.0), (2, 4.0)):
        rates = [a / b for a, b in zip(errs[order][:-1], errs[order][1:])]
        assert all(r == pytest.approx(want, rel=0.15) for r in rates), (order, errs[order])
    assert errs[2][-1] < errs[1][-1] / 10


def test_bad_sigmas_are_refused():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="sigma must be in"):
        dpm_solver_2m_step(x, x, 1.0, 0.5)
    with pytest.raises(ValueError, match="sigma_next"):
        dpm_solver_2m_step(x, x, 0.5, 0.6)
    with pytest.raises(ValueError, match="sigma_prev"):
        dpm_solver_2m_step(x, x, 0.5, 0.4, x0_prev=x, sigma_prev=0.3)
