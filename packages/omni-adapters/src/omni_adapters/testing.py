"""Helpers for checking an adapter: sampling params stand-in, per-row generators, a local
copy of the FlowGRPO SDE step, and the rollout-vs-replay log-prob agreement check.

The package may not import omni_algos, so :func:`sde_step` restates the formula here; it is
used by the tests and by anyone adding a family (docs/adding_a_model.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "Params",
    "autograd_node_names",
    "euler_sample",
    "generators",
    "pearson",
    "perturb_lora",
    "rollout_vs_replay",
    "sde_step",
]


@dataclass(frozen=True)
class Params:
    """Stand-in for diffusion_rollout.SamplingParams (adapters read it by attribute)."""

    height: int = 32
    width: int = 32
    num_frames: int = 1
    num_steps: int = 4
    guidance_scale: float = 1.0
    true_cfg_scale: float = 1.0
    noise_level: float = 0.7


def autograd_node_names(t: torch.Tensor) -> set[str]:
    """The class names of the autograd nodes ``t`` was computed through (e.g. whether a
    custom ``autograd.Function`` ran: ``"_FoldedLoRALinearBackward"``)."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def generators(seeds: list[int]) -> list[torch.Generator]:
    """One CPU generator per seed."""
    return [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]


def sde_step(x, v, sigma, sigma_next, noise_level, *, prev_sample=None, generators=None):
    """FlowGRPO SDE step (Liu et al. 2025), local test copy (omni_adapters may not import
    omni_algos): std = a sqrt(s / (1 - s')) with s' = s_next where s == 1 (else s),
    mean = x (1 + std^2 dt / (2 s)) + v (1 + std^2 (1 - s) / (2 s)) dt, dt = s_next - s < 0,
    x' = mean + std sqrt(-dt) eps; log-prob averaged over non-batch dims. Equal to
    ``omni_algos.sde.step(kind="sde")``: omni-train's test_one_implementation.py checks it."""
    x, v = x.float(), v.float()
    shape = (-1,) + (1,) * (x.dim() - 1)
    s = sigma.float().view(shape)
    sn = sigma_next.float().view(shape)
    dt = sn - s
    s_denom = torch.where(s >= 1.0, sn, s)  # 1 - s = 0 at the first step: Flow-GRPO's sigmas[1]
    std = noise_level * torch.sqrt(s / (1 - s_denom))
    mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    scale = std * torch.sqrt(-dt)
    if prev_sample is None:
        eps = torch.stack([torch.randn(x.shape[1:], generator=g) for g in generators])
        prev_sample = mean + scale * eps
    lp = (
        -((prev_sample.detach() - mean) ** 2) / (2 * scale**2)
        - torch.log(scale)
        - math.log(math.sqrt(2 * math.pi))
    )
    return prev_sample, lp.mean(dim=tuple(range(1, x.dim())))


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two tensors (flattened, float64)."""
    a = a.double().flatten() - a.double().mean()
    b = b.double().flatten() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def perturb_lora(adapter, seed: int = 0, scale: float = 0.05) -> None:
    """Give the trainable LoRA tensors non-zero values (B starts at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def rollout_vs_replay(adapter, params, prompts, seeds, encode_kwargs=None):
    """Roll out with no grad in one packed batch, then replay each step with grad in a
    different batch composition (reversed order, two halves); returns the two log-prob sets."""
    b = len(prompts)
    cond = adapter.encode(prompts, **(encode_kwargs or {}))
    gens = generators(seeds)
    x = adapter.init_latents(b, params, gens)
    sig = adapter.sigmas(params)
    xs, lps = [x], []
    with torch.no_grad():
        for i in range(params.num_steps - 1):
            v = adapter.velocity(x, sig[i].expand(b), cond, params)
            x, lp = sde_step(
                x, v, sig[i].expand(b), sig[i + 1].expand(b), params.noise_level, generators=gens
            )
            xs.append(x)
            lps.append(lp)
    rollout = torch.stack(lps, 1)  # (B, steps)
    replay = torch.zeros_like(rollout)
    order = list(range(b))[::-1]
    halves = [order[: b // 2], order[b // 2 :]]
    for i in range(params.num_steps - 1):
        for idx in halves:
            ix = torch.tensor(idx)
            c = {k: t[ix] for k, t in cond.items()}
            v = adapter.replay_velocity(xs[i][ix], sig[i].expand(len(idx)), c, params)
            assert v.requires_grad
            _, lp = sde_step(
                xs[i][ix],
                v,
                sig[i].expand(len(idx)),
                sig[i + 1].expand(len(idx)),
                params.noise_level,
                prev_sample=xs[i + 1][ix],
            )
            replay[ix, i] = lp.detach()
    return rollout, replay


@torch.no_grad()
def euler_sample(adapter, params, prompts, latents, encode_kwargs=None):
    """Deterministic Euler ODE sampling through the adapter, ``x <- x + (s' - s) v``, the
    same update as diffusers' flow-matching Euler scheduler (for comparing with a pipeline)."""
    cond = adapter.encode(list(prompts), **(encode_kwargs or {}))
    sig = adapter.sigmas(params)
    x = latents.clone()
    b = x.shape[0]
    for i in range(params.num_steps):
        x = x + (sig[i + 1] - sig[i]) * adapter.velocity(x, sig[i].expand(b), cond, params)
    return x
