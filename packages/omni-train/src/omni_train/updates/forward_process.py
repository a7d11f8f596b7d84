"""The forward-process update: DiffusionNFT and online Diffusion-DPO, on re-noised samples.

These objectives need no log-probs. They take the rollout's clean final latents ``x0`` and
noise them again,

    x_t = (1 - t) x0 + t eps,      t ~ U[lo, hi],  eps ~ N(0, I)

(the rectified-flow interpolation; the velocity target is ``eps - x0``; the draws are in the
batch, made by the loop from (run seed, step)), then compare the policy's velocity at
``(x_t, t)`` with a frozen one:

- ``diffusion_nft`` (Zheng et al. 2025, arXiv 2509.16117): against the rollout policy's own
  velocity (computed once, before the first optimizer step, so it is the sampling policy),
  each sample's group advantage turned into an optimality probability
  (`omni_algos.losses.diffusion_nft`); with ``algorithm.options.kl_weight > 0`` also against
  the reference (LoRA disabled).
- ``diffusion_dpo`` (Wallace et al. 2023, arXiv 2311.12908), online: per prompt group the
  best- and worst-rewarded samples form a pair, or the `algorithm.pairs_per_group` best
  against as many worst (`omni_algos.losses.pair_by_reward`, in the loop); winner and loser
  share ``t`` and ``eps``; the reference is the base model with the LoRA disabled.

Each clean sample is noised K = `algorithm.train_timesteps` times; the micro-batch loss is the
mean over the K draws. With `algorithm.timestep_sampling: schedule` a draw ``u`` picks a step of
the rollout's own schedule instead (`training_t`). Micro-batches, ranks and the metrics follow
`omni_train.updates.common`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from .batches import PairBatch, SampleBatch, noise_to
from .common import UpdateContext, item_groups, run_optimizer_steps
from .plan import UpdatePlan

__all__ = ["diffusion_dpo_update", "diffusion_nft_update", "training_t"]


def training_t(ctx: UpdateContext, draws: Tensor, params: Any) -> Tensor:
    """The t each clean sample is re-noised at, from the loop's draws ``u ~ U[lo, hi]`` (K, B)
    (`algorithm.timestep_range`).

    ``uniform``: t = u. ``schedule``: the sigmas of the rollout's own schedule that lie in
    ``[lo, hi]`` (``adapter.sigmas(params)``, the model's shift included, without its terminal
    0), ``s_0 > ... > s_{m-1}``, each equally likely: ``t = s_floor(m (u - lo) / (hi - lo))``.
    Those are the timesteps the sampler denoised at, where DiffusionNFT's official trainer
    re-noises (its sampling run's ``timesteps / 1000``); ``uniform`` weighs the last, nearly
    clean steps as much as the first ones, which a shifted schedule visits once.
    """
    if ctx.settings.timestep_sampling == "uniform":
        return draws
    lo, hi = ctx.settings.timestep_range
    sigmas = ctx.adapter.sigmas(params)[:-1].to(draws)
    sigmas = sigmas[(sigmas >= lo) & (sigmas <= hi)]
    if len(sigmas) == 0:
        raise ValueError(
            f"algorithm.timestep_range: no step of the rollout's schedule lies in [{lo}, {hi}] "
            "(algorithm.timestep_sampling: schedule)"
        )
    steps = ((draws - lo) / (hi - lo) * len(sigmas)).long().clamp(0, len(sigmas) - 1)
    return sigmas[steps]


def _velocities(
    adapter,
    xs: list[Tensor],
    ts: list[Tensor],
    cond: dict[str, Tensor],
    params,
    *,
    grad: bool,
    reference: bool = False,
) -> list[Tensor]:
    """The velocity at each ``(xs[i], ts[i])`` (same rows, one condition) in ONE forward."""
    n = xs[0].shape[0]
    x = torch.cat(xs)
    t = torch.cat(ts)
    c = {k: v.repeat(len(xs), *([1] * (v.ndim - 1))) for k, v in cond.items()}
    off = adapter.disabled_adapters() if reference else contextlib.nullcontext()
    with off:
        if grad:
            v = adapter.replay_velocity(x, t, c, params)
        else:
            with torch.no_grad():
                v = adapter.velocity(x, t, c, params)
    return [v[i * n : (i + 1) * n] for i in range(len(xs))]


def _rows(cond: dict[str, Tensor], idx: Tensor) -> dict[str, Tensor]:
    return {k: v[idx] for k, v in cond.items()}


def diffusion_nft_update(
    ctx: UpdateContext, batch: SampleBatch, plan: UpdatePlan
) -> dict[str, float]:
    """DiffusionNFT on one rank's rows (``batch`` holds exactly ``plan.rows``)."""
    from omni_algos.losses import LOSSES

    s, col, adapter = ctx.settings, ctx.collective, ctx.adapter
    loss_fn = LOSSES[ctx.algorithm.loss]
    t = training_t(ctx, batch.t, batch.params)
    K = t.shape[0]
    x_t = torch.stack([noise_to(batch.x0, t[k], batch.eps[k]) for k in range(K)])
    kl_weight = float(s.options.get("kl_weight", 0.0))

    def draws(idx: Tensor, ks: list[int]) -> tuple[list[Tensor], list[Tensor]]:
        return [x_t[k][idx] for k in ks], [t[k][idx] for k in ks]

    # the frozen velocities: the rollout policy's (and the reference's), before any step
    old_v = torch.empty_like(x_t)
    ref_v = torch.empty_like(x_t) if kl_weight > 0 else None
    for rows in plan.prepass:
        idx = torch.as_tensor(rows)
        cond = _rows(batch.condition, idx)
        for ks in item_groups(K, plan.prepass_pack):
            xs, ts = draws(idx, ks)
            for k, v in zip(ks, _velocities(adapter, xs, ts, cond, batch.params, grad=False)):
                old_v[k, idx] = v.to(old_v.dtype)
            if ref_v is not None:
                refs = _velocities(adapter, xs, ts, cond, batch.params, grad=False, reference=True)
                for k, v in zip(ks, refs):
                    ref_v[k, idx] = v.to(ref_v.dtype)

    def micro_loss(rows: list[int], ks: list[int], _step: int, _dummy: bool):
        idx = torch.as_tensor(rows)
        xs, ts = draws(idx, ks)
        vs = _velocities(adapter, xs, ts, _rows(batch.condition, idx), batch.params, grad=True)
        loss, metrics = 0.0, {}
        for k, v in zip(ks, vs):
            out = loss_fn(
                v,
                old_v[k][idx],
                x_t[k][idx],
                batch.x0[idx],
                t[k][idx],
                batch.advantages[idx],
                ref_velocity=None if ref_v is None else ref_v[k][idx],
                adv_clip_max=s.adv_clip_max,
                **s.options,
            )
            loss = loss + out.loss / K
            for name, val in out.metrics.items():
                metrics[name] = metrics.get(name, 0.0) + val / K
        return loss, metrics

    out = run_optimizer_steps(ctx, plan, items=K, micro_loss=micro_loss).means()
    n, t_sum = col.all_sum([float(len(plan.rows)), float(t.sum())])
    out["actor/t_mean"] = t_sum / (K * n) if n else 0.0
    return out


def diffusion_dpo_update(
    ctx: UpdateContext, batch: PairBatch, plan: UpdatePlan
) -> dict[str, float]:
    """Online Diffusion-DPO on one rank's pairs (``batch`` holds exactly ``plan.rows``)."""
    from omni_algos.losses import LOSSES

    s, adapter = ctx.settings, ctx.adapter
    loss_fn = LOSSES[ctx.algorithm.loss]
    t = training_t(ctx, batch.t, batch.params)
    K = t.shape[0]
    xw = torch.stack([noise_to(batch.x0_w, t[k], batch.eps[k]) for k in range(K)])
    xl = torch.stack([noise_to(batch.x0_l, t[k], batch.eps[k]) for k in range(K)])

    def both(idx: Tensor, ks: list[int], *, grad: bool, reference: bool = False) -> list[Tensor]:
        """Winner and loser velocities of draws ``ks`` in one forward: rows [w..., l...]."""
        cond = {
            key: torch.cat([batch.condition_w[key][idx], batch.condition_l[key][idx]])
            for key in batch.condition_w
        }
        xs = [torch.cat([xw[k][idx], xl[k][idx]]) for k in ks]
        ts = [torch.cat([t[k][idx], t[k][idx]]) for k in ks]
        return _velocities(adapter, xs, ts, cond, batch.params, grad=grad, reference=reference)

    ref_w, ref_l = torch.empty_like(xw), torch.empty_like(xl)
    for rows in plan.prepass:
        idx = torch.as_tensor(rows)
        for ks in item_groups(K, plan.prepass_pack):
            for k, v in zip(ks, both(idx, ks, grad=False, reference=True)):
                ref_w[k, idx] = v[: len(rows)].to(ref_w.dtype)
                ref_l[k, idx] = v[len(rows) :].to(ref_l.dtype)

    def micro_loss(rows: list[int], ks: list[int], _step: int, _dummy: bool):
        idx = torch.as_tensor(rows)
        n = len(rows)
        loss, metrics = 0.0, {}
        for k, v in zip(ks, both(idx, ks, grad=True)):
            out = loss_fn(
                v[:n],
                v[n:],
                ref_w[k][idx],
                ref_l[k][idx],
                batch.x0_w[idx],
                batch.x0_l[idx],
                batch.eps[k][idx],
                **s.options,
            )
            loss = loss + out.loss / K
            for name, val in out.metrics.items():
                metrics[name] = metrics.get(name, 0.0) + val / K
        return loss, metrics

    return run_optimizer_steps(ctx, plan, items=K, micro_loss=micro_loss).means()
