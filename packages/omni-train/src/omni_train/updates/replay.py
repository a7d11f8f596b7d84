"""The SDE-replay update of the FlowGRPO family (flow_grpo, dance_grpo, mix_grpo, flow_dppo,
grpo_guard): one implementation for one process and for FSDP ranks.

For each stored window step ``j`` of a trajectory, the adapter recomputes the velocity
``v_theta(x_j, sigma_j)`` under the current weights, and

    sde.step(x_j, v_theta, sigma_j, sigma_{j+1}, noise_level, kind, prev_sample=x_{j+1})

(`omni_algos.sde.step`, with the trajectory's OWN noise level and SDE kind) gives the new
log-prob ``lp_j`` and the step's Gaussian (mean, std). The algorithm's loss
(`omni_algos.losses`, inputs declared in `omni_train.algorithms`) compares ``lp_j`` with the
rollout's ``lp_old_j``; the micro-batch loss is ``(1 / W) sum_j loss_j`` over the ``W`` window
steps. With `algorithm.kl_beta > 0` the Gaussian KL to the reference (the base model, LoRA
disabled), ``mean_dims (mu - mu_ref)^2 / (2 s^2)`` (`omni_algos.losses.kl_penalty`, ``s`` the
step std), is added with weight ``kl_beta``.

Before the first optimizer step, one no-grad pass on the rollout-time weights gives what some
losses compare against: ``old_mean`` (flow_dppo, grpo_guard), the proximal log-probs of the
rollout correction (`omni_algos.correction.rollout_correction`: decoupled PPO, Hilton et al.
2021, arXiv 2110.00641, for an external/bf16 engine or stale async samples), and the per-row
step stds whose minibatch means grpo_guard's RatioNorm reads.

Several window steps go through one forward when the micro-batch is small enough
(`UpdatePlan` ``pack``): the rows of steps ``j1, j2, ...`` are concatenated with their own
sigmas (the velocity takes one sigma per row), which gives the same gradients as one forward
per step with fewer, larger forwards.

With `algorithm.reuse_rollout_forward` the batch's log-probs carry the rollout's own autograd
graph (`diffusion_rollout.wave`, ``differentiable``): the rollout ran on these very weights, so
the replay would recompute its forwards. The loss then reads ``lp_j`` from the batch (the
anchor ``lp_old_j`` is its value, ratio 1) and the one backward of the one micro-batch
(`update_plans`) goes through the rollout's forwards: the replay's gradient, without its
forwards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from .batches import ReplayBatch
from .common import (
    KL_METRIC_ROWS,
    MeanMetrics,
    UpdateContext,
    item_groups,
    kl_metric_rows,
    run_optimizer_steps,
)
from .plan import UpdatePlan

__all__ = ["ReplayedStep", "replay_steps", "sde_replay_update", "sde_step_rows"]

#: `omni_algos.correction` metrics that are not means over the rows (reduced otherwise)
CORRECTION_NOT_MEANS = ("logprob_abs_diff_max", "pearson")


@dataclass
class ReplayedStep:
    """One window step of some rows under the current weights (shapes (n,) but ``mean``)."""

    log_prob: Tensor
    mean: Tensor
    std: Tensor
    sqrt_dt: Tensor
    #: the std of the step's Gaussian (``std sqrt_dt`` for kind "sde", ``std`` otherwise)
    step_std: Tensor


def sde_step_rows(
    x: Tensor,
    v: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    prev: Tensor,
    kinds: list[str],
    noise_levels: Tensor,
) -> ReplayedStep:
    """`omni_algos.sde.step` for rows that may differ in SDE kind and noise level: one call
    per (kind, noise level) group, results in row order."""
    from omni_algos import sde

    groups: dict[tuple[str, float], list[int]] = {}
    for i, (k, nl) in enumerate(zip(kinds, noise_levels.tolist())):
        groups.setdefault((k, nl), []).append(i)
    parts = []
    for (kind, nl), rows in groups.items():
        sel = slice(None) if len(rows) == len(kinds) else torch.as_tensor(rows)
        out = sde.step(
            x[sel],
            v[sel],
            sigma[sel],
            sigma_next[sel],
            noise_level=nl,
            kind=kind,
            prev_sample=prev[sel],
        )
        step_std = out.std * out.sqrt_dt if kind == "sde" else out.std
        parts.append((rows, out, step_std))
    if len(parts) == 1:
        _, out, step_std = parts[0]
        return ReplayedStep(out.log_prob, out.mean, out.std, out.sqrt_dt, step_std)
    # back to row order: the groups' rows concatenated, then the inverse permutation
    inv = torch.argsort(torch.as_tensor([r for rows, _, _ in parts for r in rows]))

    def cat(get) -> Tensor:
        return torch.cat([get(out, step_std) for _, out, step_std in parts])[inv]

    return ReplayedStep(
        cat(lambda o, _: o.log_prob),
        cat(lambda o, _: o.mean),
        cat(lambda o, _: o.std),
        cat(lambda o, _: o.sqrt_dt),
        cat(lambda _, ss: ss),
    )


def replay_steps(
    adapter,
    batch: ReplayBatch,
    rows: list[int],
    js: list[int],
    *,
    grad: bool,
    reference: bool = False,
) -> list[ReplayedStep]:
    """Window steps ``js`` of ``rows`` (positions into ``batch``) in ONE velocity forward.

    ``grad``: with autograd (the training replay); ``reference``: with the LoRA adapters
    disabled (the KL reference)."""
    idx = torch.as_tensor(rows, dtype=torch.long)
    n = len(rows)
    lat = batch.latents
    x = torch.cat([lat[idx, j] for j in js])
    sig = torch.cat([batch.sigmas[idx, j] for j in js])
    cond = {k: v[idx].repeat(len(js), *([1] * (v.ndim - 1))) for k, v in batch.condition.items()}
    off = adapter.disabled_adapters() if reference else contextlib.nullcontext()
    with off:
        if grad:
            v = adapter.replay_velocity(x, sig, cond, batch.params)
        else:
            with torch.no_grad():
                v = adapter.velocity(x, sig, cond, batch.params)
    kinds = [batch.sde_kinds[r] for r in rows]
    noise = batch.noise_levels[idx]
    out = []
    for i, j in enumerate(js):
        sl = slice(i * n, (i + 1) * n)
        out.append(
            sde_step_rows(
                lat[idx, j],
                v[sl],
                batch.sigmas[idx, j],
                batch.sigmas_next[idx, j],
                lat[idx, j + 1],
                kinds,
                noise,
            )
        )
    return out


def sde_replay_update(
    ctx: UpdateContext, batch: ReplayBatch, plan: UpdatePlan, *, correction: str | None = None
) -> dict[str, float]:
    """Train on one rank's rows of a rollout batch (``batch`` holds exactly ``plan.rows``);
    returns the minibatch-reduced metrics (equal on every rank).

    ``correction``: None, or "decoupled" / "bypass" (`omni_algos.correction`): per-sample
    weights for log-probs that the rollout engine computed under other weights or kernels."""
    from omni_algos.correction import pearson_from_sums, pearson_sums, rollout_correction
    from omni_algos.losses import LOSSES, kl_penalty

    alg, s, col = ctx.algorithm, ctx.settings, ctx.collective
    loss_fn = LOSSES[alg.loss]
    n_rows, W = batch.log_probs.shape
    needs = set(alg.loss_inputs)
    # reuse_rollout_forward: the log-probs are the rollout's, with its graph (module docstring)
    from_rollout = batch.log_probs.requires_grad
    old_lp = batch.log_probs.detach()
    if from_rollout and (
        needs & {"mean", "std", "std_mean"} or correction is not None or s.kl_beta > 0
    ):
        raise ValueError(
            f"{alg.name}: the update reads more than the rollout's log-probs (mean, std, the KL "
            "reference or a correction), so it cannot train on the rollout's own graph "
            "(algorithm.reuse_rollout_forward)"
        )
    if from_rollout and (len(plan.steps) != 1 or len(plan.steps[0].chunks) != 1):
        # a second backward would walk a graph the first one freed, on weights it changed
        raise ValueError(
            "the rollout's own graph trains one optimizer step of one micro-batch "
            f"(algorithm.reuse_rollout_forward); the plan has {len(plan.steps)} steps and "
            f"{len(plan.steps[0].chunks)} micro-batches in the first (use update_plans)"
        )

    # 1. one no-grad pass on the rollout-time weights (before any optimizer step)
    old_mean = prox = std = sqrt_dt = None
    if needs & {"mean", "std_mean"} or correction is not None:
        old_mean = torch.empty_like(batch.latents[:, :W])
        prox, std, sqrt_dt = (torch.empty_like(old_lp) for _ in range(3))
        for rows in plan.prepass:
            idx = torch.as_tensor(rows)
            for js in item_groups(W, plan.prepass_pack):
                for j, out in zip(js, replay_steps(ctx.adapter, batch, rows, js, grad=False)):
                    old_mean[idx, j] = out.mean.to(old_mean.dtype)
                    prox[idx, j] = out.log_prob.float()
                    std[idx, j] = out.std.float()
                    sqrt_dt[idx, j] = out.sqrt_dt.float()
    anchor, weights, corr_metrics = old_lp, None, MeanMetrics()
    if correction is not None:
        cc = rollout_correction(prox, old_lp, mode=correction, is_level="token")
        weights = cc.weights.float()
        if correction == "decoupled":  # the trainer's own log-probs anchor the ratio
            anchor = prox
        # the whole batch's metrics: row-weighted means, but a max is a max over ranks and a
        # correlation comes from the ranks' summed moments
        share = n_rows / col.all_sum([n_rows])[0]
        means = {k: v for k, v in cc.metrics.items() if k not in CORRECTION_NOT_MEANS}
        corr_metrics.add_reduced(col, {f"correction/{k}": v * share for k, v in means.items()})
        (diff_max,) = col.all_max([cc.metrics["logprob_abs_diff_max"]])
        corr_metrics.add("correction/logprob_abs_diff_max", diff_max)
        moments = col.all_sum(pearson_sums(prox, old_lp))
        corr_metrics.add("correction/pearson", pearson_from_sums(moments))

    # 2. RatioNorm's batch statistics: std and sqrt(-dt) averaged over the whole minibatch
    std_means: dict[int, tuple[float, float]] = {}

    def minibatch_std_means(_step, real_rows: list[int]) -> None:
        idx = torch.as_tensor(real_rows, dtype=torch.long)
        sums = [float(t[idx, j].sum()) for j in range(W) for t in (std, sqrt_dt)]
        red = col.all_sum([*sums, float(len(real_rows))])
        for j in range(W):
            std_means[j] = (red[2 * j] / red[-1], red[2 * j + 1] / red[-1])

    # 3. the optimizer steps; the first runs on the rollout weights (log-prob agreement)
    diff = [0.0, 0.0, 0.0]  # sum, count, max of |lp - lp_rollout|

    def micro_loss(rows: list[int], js: list[int], n_step: int, dummy: bool):
        idx = torch.as_tensor(rows, dtype=torch.long)
        if from_rollout:
            outs = None
            log_probs = [batch.log_probs[idx, j] for j in js]
        else:
            outs = replay_steps(ctx.adapter, batch, rows, js, grad=True)
            log_probs = [out.log_prob for out in outs]
        refs = None
        if s.kl_beta > 0:
            refs = replay_steps(ctx.adapter, batch, rows, js, grad=False, reference=True)
        loss, metrics = 0.0, {}
        for i, (j, log_prob) in enumerate(zip(js, log_probs)):
            out = outs[i] if outs is not None else None
            if n_step == 0 and not dummy:
                d = (log_prob.detach() - old_lp[idx, j]).abs()
                diff[0], diff[1] = diff[0] + float(d.sum()), diff[1] + d.numel()
                diff[2] = max(diff[2], float(d.max()))
            kw: dict = {}
            if "clip_range" in needs and s.clip_range is not None:
                kw["clip_range"] = s.clip_range
            if "adv_clip_max" in needs:
                kw["adv_clip_max"] = s.adv_clip_max
            if "mean" in needs:
                kw["mean"], kw["old_mean"] = out.mean, old_mean[idx, j]
            if "std" in needs:
                kw["std"], kw["sqrt_dt"] = out.std, out.sqrt_dt
            if "std_mean" in needs:
                kw["std"], kw["sqrt_dt"] = std_means[j]
            if weights is not None:
                kw["weights"] = weights[idx, j]
            lo = loss_fn(
                log_prob=log_prob,
                old_log_prob=anchor[idx, j],
                advantages=batch.advantages[idx],
                **kw,
                **s.options,
            )
            step_loss = lo.loss
            if refs is not None:  # KL to the reference, in the step Gaussian's own std
                kl = kl_penalty(out.mean, refs[i].mean, out.step_std)
                step_loss = step_loss + s.kl_beta * kl.loss
                lo.metrics["kl_ref"] = kl.metrics["kl"]
            loss = loss + step_loss / W
            for k, v in lo.metrics.items():
                metrics[k] = metrics.get(k, 0.0) + v / W
        return loss, metrics

    metrics = run_optimizer_steps(
        ctx,
        plan,
        items=W,
        micro_loss=micro_loss,
        on_step=minibatch_std_means if "std_mean" in needs else None,
    )
    out = metrics.means()
    out.update(corr_metrics.means())
    if s.measure_kl_ref:  # where the updated policy stands: its KL to the LoRA-off reference
        first = plan.prepass[0]  # a micro-batch every rank has: collectives agree
        rows = kl_metric_rows(first)
        # as many window steps per forward as the prepass's forwards hold rows; from the
        # largest rank's micro-batch, so every rank runs the same number of forwards
        held = int(col.all_max([float(len(first))])[0])
        pack = min(W, max(plan.prepass_pack, held * plan.prepass_pack // KL_METRIC_ROWS))
        kl_sum = 0.0
        for js in item_groups(W, pack):
            now = replay_steps(ctx.adapter, batch, rows, js, grad=False)
            ref = replay_steps(ctx.adapter, batch, rows, js, grad=False, reference=True)
            for a_, b_ in zip(now, ref):
                kl = kl_penalty(a_.mean, b_.mean, a_.step_std).metrics["kl"]
                kl_sum += kl * len(rows) / W
        total, n = col.all_sum([kl_sum, float(len(rows))])
        out["policy/kl_to_ref"] = total / n
    s_, c_ = col.all_sum(diff[:2])
    out["rollout/logprob_diff_mean"] = s_ / max(c_, 1.0)
    out["rollout/logprob_diff_max"] = col.all_max([diff[2]])[0]
    return out
