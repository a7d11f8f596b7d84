"""Policy-gradient losses over flow-matching SDE steps: Flow-GRPO and its relatives.

Inputs are per-step log-probs as returned by :func:`omni_algos.sde.step` (shape (B,), or any
shape whose leading dims match ``advantages``). All math in ``max(float32, input dtype)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import (
    as_float,
    check_same_shape,
    compute_dtype,
    expand_rows,
    mean_dims,
    ratio_metrics,
    spread_metrics,
    weighted_mean,
)
from ._registry import LossOutput, register

__all__ = ["dance_grpo", "flow_dppo", "flow_grpo", "grpo_guard", "kl_penalty", "mix_grpo"]


def _ppo_clip(
    ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """Per-element PPO loss ``max(-A r, -A clip(r, 1 - lo, 1 + hi))`` and the clipped ratio."""
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(-adv * ratio, -adv * clipped), clipped


@register("flow_grpo")
def flow_grpo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
    weights: Tensor | None = None,
) -> LossOutput:
    r"""Flow-GRPO clipped policy loss (Liu et al. 2025, arXiv 2505.05470).

    ``r = exp(lp - lp_old)``, ``A = clamp(advantages, -adv_clip_max, adv_clip_max)``,
    ``loss = mean(w * max(-A r, -A clip(r, 1 - eps, 1 + eps)))`` with ``eps = clip_range``
    and ``w`` the optional per-sample weights (e.g. rollout-correction weights; default 1).

    Metrics: ``policy_loss``, ``ratio_mean``, ``ratio_std``, ``ratio_dev_sq_mean``,
    ``clipfrac`` (= higher + lower), ``clipfrac_higher`` (r - 1 > eps), ``clipfrac_lower``
    (1 - r > eps),
    ``approx_kl = 0.5 mean((lp - lp_old)^2)``, ``advantage_mean``.
    """
    dtype = compute_dtype(log_prob, old_log_prob, advantages)
    lp = as_float(log_prob, dtype)
    old = as_float(old_log_prob, dtype, lp.device).detach()
    check_same_shape("log_prob", lp, "old_log_prob", old)
    adv = expand_rows(as_float(advantages, dtype, lp.device).detach(), lp, "advantages")
    adv = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    per, _ = _ppo_clip(ratio, adv, clip_range, clip_range)
    loss = weighted_mean(per, as_float(weights, dtype, lp.device))
    metrics = {"policy_loss": float(loss.detach()), "advantage_mean": float(adv.mean())}
    metrics.update(ratio_metrics(ratio, log_ratio, clip_range, clip_range))
    return LossOutput(loss, metrics)


@register("dance_grpo")
def dance_grpo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
    weights: Tensor | None = None,
) -> LossOutput:
    """DanceGRPO (Xue et al. 2025, arXiv 2505.07818): the same clipped ratio loss as
    :func:`flow_grpo`, used with ``sde.step(kind="dance")`` log-probs."""
    return flow_grpo(
        log_prob,
        old_log_prob,
        advantages,
        clip_range=clip_range,
        adv_clip_max=adv_clip_max,
        weights=weights,
    )


@register("mix_grpo")
def mix_grpo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
    weights: Tensor | None = None,
) -> LossOutput:
    """MixGRPO (Li et al. 2025, arXiv 2507.21802): :func:`flow_grpo` over the steps of a
    MixGRPO window (:func:`omni_algos.sde.mix_grpo_window`); SDE inside the window, ODE
    outside, so only window steps carry log-probs."""
    return flow_grpo(
        log_prob,
        old_log_prob,
        advantages,
        clip_range=clip_range,
        adv_clip_max=adv_clip_max,
        weights=weights,
    )


def kl_penalty(
    mean: Tensor,
    ref_mean: Tensor,
    std: Tensor | float,
    *,
    weights: Tensor | None = None,
) -> LossOutput:
    r"""KL between two Gaussian steps with the same std (Flow-GRPO's KL regulariser). A term
    added to a policy loss, not an algorithm, so it is not in ``LOSSES``:

    ``KL_b = mean_dims (mean - ref_mean)^2 / (2 std_b^2)``, ``loss = mean_b(w_b KL_b)``.

    ``std`` is the per-row std of the step's Gaussian (B,) or a float. For kind ``"sde"``
    the exact Gaussian KL uses ``step.std * step.sqrt_dt``. Metrics: ``kl``.
    """
    dtype = compute_dtype(mean, ref_mean, std if isinstance(std, Tensor) else None)
    m = as_float(mean, dtype)
    ref = as_float(ref_mean, dtype, m.device).detach()
    check_same_shape("mean", m, "ref_mean", ref)
    s = as_float(std, dtype, m.device).detach()
    if s.ndim == 1:
        s = s.reshape(-1, *([1] * (m.ndim - 1)))
    if bool((s <= 0).any()):
        raise ValueError("kl_penalty: std must be > 0")
    kl = mean_dims((m - ref) ** 2 / (2 * s**2))
    loss = weighted_mean(kl, as_float(weights, dtype, m.device))
    return LossOutput(loss, {"kl": float(kl.detach().mean())})


@register("flow_dppo")
def flow_dppo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mean: Tensor,
    old_mean: Tensor,
    *,
    std: Tensor | float | None = None,
    sqrt_dt: Tensor | float | None = None,
    threshold: float = 1e-5,
    weights: Tensor | None = None,
) -> LossOutput:
    r"""Divergence-masked policy gradient without ratio clipping (Flow-DPPO).

    Per sample: ``D = mean_dims (mean - mean_old)^2 / (2 (s sqrt(-dt))^2)`` (the Gaussian KL
    between the new and old step), or ``mean_dims (mean - mean_old)^2 / 2`` when ``std`` or
    ``sqrt_dt`` is None. A sample is masked out (``M = 1``) when it has already moved far
    (``D >= threshold``) *and* further in the direction its advantage pushes
    (``r > 1, A > 0`` or ``r < 1, A < 0``, ``r = exp(lp - lp_old)``):

    ``loss = mean(w * (1 - M) * (-A r))``. No ratio clip and no advantage clip: the mask is
    the trust region.

    Metrics: ``policy_loss``, ``mask_frac`` (fraction masked), ``divergence_mean``, ratio stats.
    """
    dtype = compute_dtype(log_prob, old_log_prob, advantages, mean, old_mean)
    lp = as_float(log_prob, dtype)
    old = as_float(old_log_prob, dtype, lp.device).detach()
    check_same_shape("log_prob", lp, "old_log_prob", old)
    adv = expand_rows(as_float(advantages, dtype, lp.device).detach(), lp, "advantages")
    m = as_float(mean, dtype, lp.device)
    m_old = as_float(old_mean, dtype, lp.device).detach()
    check_same_shape("mean", m, "old_mean", m_old)
    sq = (m.detach() - m_old) ** 2 / 2
    if std is not None and sqrt_dt is not None:
        var = (as_float(std, dtype, lp.device) * as_float(sqrt_dt, dtype, lp.device)) ** 2
        if var.ndim == 1:
            var = var.reshape(-1, *([1] * (m.ndim - 1)))
        sq = sq / var
    div = mean_dims(sq)
    div = expand_rows(div, lp, "divergence")
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    mask = (div >= threshold) & (((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
    keep = (~mask).to(dtype).detach()
    loss = weighted_mean(keep * (-adv * ratio), as_float(weights, dtype, lp.device))
    metrics = {
        "policy_loss": float(loss.detach()),
        "mask_frac": float(mask.float().mean()),
        "divergence_mean": float(div.mean()),
    }
    metrics.update(ratio_metrics(ratio, log_ratio, float("inf"), float("inf")))
    return LossOutput(loss, metrics)


@register("grpo_guard")
def grpo_guard(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mean: Tensor,
    old_mean: Tensor,
    std: Tensor | float,
    sqrt_dt: Tensor | float,
    *,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
    weights: Tensor | None = None,
) -> LossOutput:
    r"""GRPO-Guard: Flow-GRPO with RatioNorm (Wang et al. 2025, arXiv 2510.22319).

    The log-ratio of two Gaussian steps is biased by the mean shift and its scale varies with
    the step's std. RatioNorm removes the bias and rescales:

    ``s = mean_b(sqrt(-dt)) * mean_b(std)``, ``b = mean_dims (mean - mean_old)^2 / (2 s^2)``,
    ``r = exp((lp - lp_old + b) s)``, PPO clip as in :func:`flow_grpo` (advantages clipped to
    ``±adv_clip_max``), and the loss divided by ``mean_b(sqrt(-dt))^2`` so each step's
    gradient has a comparable size. ``std`` and ``sqrt_dt`` are ``SDEStep.std`` and
    ``SDEStep.sqrt_dt`` (B,) or floats.
    """
    dtype = compute_dtype(log_prob, old_log_prob, advantages, mean, old_mean)
    lp = as_float(log_prob, dtype)
    old = as_float(old_log_prob, dtype, lp.device).detach()
    check_same_shape("log_prob", lp, "old_log_prob", old)
    adv = expand_rows(as_float(advantages, dtype, lp.device).detach(), lp, "advantages")
    adv = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    m = as_float(mean, dtype, lp.device)
    m_old = as_float(old_mean, dtype, lp.device).detach()
    check_same_shape("mean", m, "old_mean", m_old)
    sdt = as_float(sqrt_dt, dtype, lp.device).detach().mean()
    s = sdt * as_float(std, dtype, lp.device).detach().mean()
    if float(s) <= 0:
        raise ValueError("grpo_guard: mean(std) * mean(sqrt_dt) must be > 0")
    bias = expand_rows(mean_dims((m - m_old) ** 2) / (2 * s**2), lp, "bias")
    log_ratio = (lp - old + bias) * s
    ratio = torch.exp(log_ratio)
    per, _ = _ppo_clip(ratio, adv, clip_range, clip_range)
    loss = weighted_mean(per, as_float(weights, dtype, lp.device)) / sdt**2
    metrics = {"policy_loss": float(loss.detach()), "ratio_norm_scale": float(s)}
    metrics.update(ratio_metrics(ratio, log_ratio, clip_range, clip_range))
    metrics.update(spread_metrics("raw_ratio", torch.exp(lp - old)))
    return LossOutput(loss, metrics)
