"""The token update of GSPO / GRPO on an autoregressive thinker (e.g. the Qwen3-Omni thinker).

`ThinkerAdapter.token_log_probs` replays the sampled responses with grad under the current
weights (the same masked distribution as the rollout with `rollout.allowed_tokens`), and the
token loss (`omni_algos.losses.gspo`: Zheng et al. 2025, arXiv 2507.18071, the sequence
ratio ``s_i = exp(mean_t(lp_t - lp_old_t))``; or token-level `grpo`) compares them with the
rollout's. With `algorithm.kl_beta > 0` the k3 estimator of KL to the base model (LoRA
disabled), ``exp(d) - d - 1`` with ``d = lp_ref - lp`` (`omni_algos.losses.k3_kl`), is added.

Loss units (`omni_train.updates.common`) follow the loss's aggregation
(`omni_algos.losses.agg_loss`): tokens for ``token-mean``, non-empty responses for the
``seq-mean-*`` modes, so a minibatch split over ranks or micro-batches gets the loss of one
undivided pass (``seq-mean-token-sum-norm`` normalises by the micro-batch's padded length, so
it is split-exact only when the lengths agree).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .batches import TokenBatch
from .common import UpdateContext, kl_metric_rows, run_optimizer_steps
from .plan import UpdatePlan

__all__ = ["token_loss_options", "token_update"]


def token_loss_options(
    loss: str, options: dict[str, Any], clip_range: float | None, agg: str
) -> dict[str, Any]:
    """The keyword options of token loss `loss` (`omni_algos.losses.LOSSES`), as every backend
    passes them (the local and Ray updates here, verl through
    `omni_train.backends.verl_backend.build_verl_config`): `algorithm.options`, with each of
    ``clip_low`` / ``clip_high`` that it does not set taken from `algorithm.clip_range` when
    the recipe sets it, else from the loss's own default; ``agg`` from the options, else
    `agg` (the algorithm's)."""
    from omni_algos.losses import LOSSES

    params = inspect.signature(LOSSES[loss]).parameters
    out = {**options, "agg": options.get("agg", agg)}
    for side in ("clip_low", "clip_high"):
        if side not in out:
            out[side] = clip_range if clip_range is not None else params[side].default
    return out


def token_update(ctx: UpdateContext, batch: TokenBatch, plan: UpdatePlan) -> dict[str, float]:
    """Train on one rank's rows of a token batch (``batch`` holds exactly ``plan.rows``)."""
    from omni_algos.losses import LOSSES, k3_kl

    s, col, adapter = ctx.settings, ctx.collective, ctx.adapter
    loss_fn = LOSSES[ctx.algorithm.loss]
    opts = token_loss_options(ctx.algorithm.loss, s.options, s.clip_range, ctx.algorithm.token_agg)
    agg = str(opts["agg"])
    lengths = batch.mask.sum(-1)

    def units(rows: list[int]) -> float:
        idx = torch.as_tensor(rows, dtype=torch.long)
        if agg == "token-mean":
            return float(lengths[idx].sum())
        return float((lengths[idx] > 0).sum())

    def replay(rows: list[int], reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(rows, dtype=torch.long)
        t = max(int(lengths[idx].max()), 1)
        images = [batch.images[i] for i in rows if batch.images and batch.images[i] is not None]
        inputs = adapter.build_batch([batch.contents[i] for i in rows], images=images or None)
        rb = {
            **inputs,
            "responses": batch.tokens[idx, :t],
            "response_mask": batch.mask[idx, :t],
            "temperature": batch.temperature,
            "allowed_tokens": None if s.allowed_tokens is None else list(s.allowed_tokens),
        }
        if reference:
            with torch.no_grad(), adapter.disabled_adapters():
                return adapter.token_log_probs(rb), batch.mask[idx, :t]
        return adapter.token_log_probs(rb), batch.mask[idx, :t]

    diff = [0.0, 0.0, 0.0]  # sum, count, max of |lp - lp_rollout| on the rollout weights

    def micro_loss(rows: list[int], _items: list[int], n_step: int, dummy: bool):
        idx = torch.as_tensor(rows, dtype=torch.long)
        lp, m = replay(rows)
        old = batch.log_probs[idx, : lp.shape[1]]
        if n_step == 0 and not dummy:
            d = (lp.detach() - old).abs()[m]
            if d.numel():
                diff[0], diff[1] = diff[0] + float(d.sum()), diff[1] + d.numel()
                diff[2] = max(diff[2], float(d.max()))
        lo = loss_fn(
            log_prob=lp, old_log_prob=old, advantages=batch.advantages[idx], mask=m, **opts
        )
        loss = lo.loss
        if s.kl_beta > 0:
            ref, _ = replay(rows, reference=True)
            kl = k3_kl(lp, ref, m)
            loss = loss + s.kl_beta * kl
            lo.metrics["kl_ref"] = float(kl.detach())
        return loss, lo.metrics

    out = run_optimizer_steps(ctx, plan, items=1, micro_loss=micro_loss, units=units).means()
    if s.measure_kl_ref:  # where the updated policy stands: its k3 KL to the LoRA-off model
        rows = kl_metric_rows(plan.prepass[0])
        with torch.no_grad():
            lp, m = replay(rows)
        ref, _ = replay(rows, reference=True)
        total, n = col.all_sum([float(k3_kl(lp, ref, m)) * len(rows), float(len(rows))])
        out["policy/kl_to_ref"] = total / n
    # one name for the ratio and the KL across gspo (sequence ratio) and grpo (token ratio)
    if "actor/seq_ratio_mean" in out:
        out["actor/ratio_mean"] = out["actor/seq_ratio_mean"]
    if "actor/ppo_kl" in out:
        out["actor/approx_kl"] = out["actor/ppo_kl"]
    s_, c_ = col.all_sum(diff[:2])
    out["rollout/logprob_abs_diff_mean"] = s_ / max(c_, 1.0)
    out["rollout/logprob_abs_diff_max"] = col.all_max([diff[2]])[0]
    return out
