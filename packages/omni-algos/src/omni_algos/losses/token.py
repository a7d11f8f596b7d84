"""Token-level policy losses for autoregressive (omni / LLM) policies: GRPO and GSPO.

Inputs are per-token log-probs ``(B, T)`` with a response ``mask`` ``(B, T)`` (1 = a
generated token that is trained on); ``advantages`` is ``(B,)`` or ``(B, T)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import as_float, check_same_shape, compute_dtype, expand_rows
from ._registry import LossOutput, register

__all__ = ["AGG_MODES", "agg_loss", "grpo", "gspo", "k3_kl"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: Tensor, mask: Tensor, agg: str = "token-mean", norm: float | None = None
) -> Tensor:
    r"""Aggregate a per-token loss ``(B, T)`` under ``mask`` into a scalar.

    - ``token-mean``: ``sum(l m) / sum(m)`` (every token weighs the same);
    - ``seq-mean-token-mean``: mean over non-empty rows of ``sum_t(l m) / sum_t(m)``;
    - ``seq-mean-token-sum``: mean over non-empty rows of ``sum_t(l m)``;
    - ``seq-mean-token-sum-norm``: mean over non-empty rows of ``sum_t(l m) / norm``, with
      ``norm = T`` by default: Dr. GRPO's constant normaliser in place of each response's
      length (Liu et al. 2025, arXiv 2503.20783; verl's mode of the same name).

    Fully masked rows are excluded; an all-masked batch gives a zero loss (still connected to
    the graph).
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    if loss_mat.ndim != 2:
        raise ValueError(f"loss must have shape (B, T), got {tuple(loss_mat.shape)}")
    m = mask.to(loss_mat.dtype)
    masked = loss_mat * m
    tok = m.sum(dim=-1)
    rows = (tok > 0).to(loss_mat.dtype)
    if agg == "token-mean":
        return masked.sum() / m.sum().clamp(min=1)
    seq = masked.sum(dim=-1)
    if agg == "seq-mean-token-mean":
        seq = seq / tok.clamp(min=1)
    if agg == "seq-mean-token-sum-norm":
        seq = seq / (loss_mat.shape[-1] if norm is None else norm)
    return (seq * rows).sum() / rows.sum().clamp(min=1)


def _prep(log_prob, old_log_prob, advantages, mask):
    dtype = compute_dtype(log_prob, old_log_prob, advantages)
    lp = as_float(log_prob, dtype)
    if lp.ndim != 2:
        raise ValueError(f"log_prob must have shape (B, T), got {tuple(lp.shape)}")
    old = as_float(old_log_prob, dtype, lp.device).detach()
    check_same_shape("log_prob", lp, "old_log_prob", old)
    if mask is None:
        m = torch.ones_like(lp)
    else:
        m = mask.to(device=lp.device, dtype=dtype)
        check_same_shape("log_prob", lp, "mask", m)
    adv = expand_rows(as_float(advantages, dtype, lp.device).detach(), lp, "advantages")
    return lp, old, adv, m


def _masked_mean(t: Tensor, m: Tensor) -> float:
    den = float(m.sum())
    return float((t.detach() * m).sum()) / den if den > 0 else 0.0


@register("grpo")
def grpo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    agg: str = "token-mean",
) -> LossOutput:
    r"""Token-level PPO-clip loss as used by GRPO (Shao et al. 2024, arXiv 2402.03300).

    ``r_t = exp(clamp(lp_t - lp_old_t, -20, 20))``,
    ``l_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))``; with ``clip_ratio_c``
    (dual-clip PPO, Ye et al. 2020) negative-advantage tokens are bounded by
    ``min(l_t, -A c)``. Aggregated with :func:`agg_loss` (``clip_high > clip_low`` is DAPO's
    clip-higher). Metrics: ``policy_loss``, ``clipfrac``, ``clipfrac_lower`` (dual clip),
    ``ppo_kl`` (masked mean of ``lp_old - lp``), ``ratio_mean``.
    """
    lp, old, adv, m = _prep(log_prob, old_log_prob, advantages, mask)
    log_ratio = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(l1, l2)
    per = clipped
    lower = torch.zeros_like(per)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        l3 = -adv * clip_ratio_c
        per = torch.where(adv < 0, torch.minimum(l3, clipped), clipped)
        lower = ((clipped > l3) & (adv < 0)).to(per.dtype)
    loss = agg_loss(per, m, agg)
    metrics = {
        "policy_loss": float(loss.detach()),
        "clipfrac": _masked_mean((l2 > l1).to(per.dtype), m),
        "clipfrac_lower": _masked_mean(lower, m),
        "ppo_kl": _masked_mean(-(lp - old), m),
        "ratio_mean": _masked_mean(ratio, m),
    }
    return LossOutput(loss, metrics)


@register("gspo")
def gspo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
) -> LossOutput:
    r"""GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071).

    Sequence-level ratio ``s_i = exp(sum_t m_t (lp_t - lp_old_t) / sum_t m_t)`` (the
    length-normalised sequence likelihood ratio), in its token form
    ``s_{i,t} = sg(s_i) exp(lp_t - sg(lp_t))`` (value ``s_i``, gradient
    ``s_i grad lp_t``), with the log clamped at 10:

    ``log s_{i,t} = min(lp_t - sg(lp_t) + sg(log s_i), 10)``,
    ``l_{i,t} = max(-A_i s_{i,t}, -A_i clip(s_{i,t}, 1 - clip_low, 1 + clip_high))``,
    aggregated with :func:`agg_loss` (default ``seq-mean-token-mean``: each sequence
    weighs the same, as in the paper). Fully masked rows are excluded.

    Metrics: ``policy_loss``, ``clipfrac``, ``ppo_kl``, ``seq_ratio_mean``.
    """
    lp, old, adv, m = _prep(log_prob, old_log_prob, advantages, mask)
    tok = m.sum(dim=-1)
    seq_log_ratio = ((lp - old) * m).sum(dim=-1) / tok.clamp(min=1)
    log_ratio = lp - lp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    log_ratio = torch.clamp(log_ratio, max=10.0)
    ratio = torch.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per = torch.maximum(l1, l2)
    loss = agg_loss(per, m, agg)
    rows = tok > 0
    metrics = {
        "policy_loss": float(loss.detach()),
        "clipfrac": _masked_mean((l2 > l1).to(per.dtype), m),
        "ppo_kl": _masked_mean(-(lp - old), m),
        "seq_ratio_mean": float(torch.exp(seq_log_ratio.detach()[rows]).mean())
        if bool(rows.any())
        else 1.0,
    }
    return LossOutput(loss, metrics)


def k3_kl(log_prob: Tensor, ref_log_prob: Tensor, mask: Tensor) -> Tensor:
    """Masked token mean of the k3 KL estimator ``exp(d) - d - 1``, ``d = lp_ref - lp``
    (Schulman 2020, "Approximating KL divergence"): unbiased for KL(pi || pi_ref) under
    samples of pi and never negative. ``ref_log_prob`` is a constant; ``d`` is clamped to
    [-20, 20] so a far-off token cannot overflow."""
    d = (ref_log_prob.detach() - log_prob).clamp(-20.0, 20.0)
    m = mask.to(log_prob.dtype)
    return ((torch.exp(d) - d - 1.0) * m).sum() / m.sum().clamp(min=1.0)
