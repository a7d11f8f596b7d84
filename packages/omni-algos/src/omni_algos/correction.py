"""Rollout correction: importance weights and rejection for rollout/trainer mismatch.

The rollout engine (vLLM, a batched diffusion engine, bf16 kernels...) and the trainer compute
slightly different log-probs for the same sample. Truncated importance sampling (TIS) and
masked / rejection sampling (MIS) correct for that mismatch (Yao et al. 2025, "Your efficient
RL framework secretly brings you off-policy RL training"; Espeholt et al. 2018, IMPALA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "CORRECTION_MODES",
    "Correction",
    "pearson_from_sums",
    "pearson_sums",
    "rollout_correction",
]

CORRECTION_MODES = ("bypass", "decoupled")


@dataclass
class Correction:
    """``weights`` multiply the per-sample (or per-token) loss; ``mask`` is 1 where the sample
    is kept (0 = rejected; rejected entries also have weight 0). Metrics are Python floats."""

    weights: Tensor
    mask: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def pearson_sums(a: Tensor, b: Tensor) -> list[float]:
    """``[n, sum a, sum b, sum a^2, sum b^2, sum ab]`` in float64: what Pearson's correlation
    is computed from. Sums add over shards of the data, so data-parallel ranks all-reduce
    them and call `pearson_from_sums` to get the whole batch's correlation."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return [float(a.numel()), *(float(t.sum()) for t in (a, b, a * a, b * b, a * b))]


def pearson_from_sums(sums: list[float]) -> float:
    r"""Pearson's correlation from `pearson_sums`' values:
    ``r = (n sum ab - sum a sum b) / sqrt((n sum a^2 - (sum a)^2) (n sum b^2 - (sum b)^2))``,
    0 for fewer than two values or a constant side."""
    n, sa, sb, saa, sbb, sab = sums
    if n < 2:
        return 0.0
    va, vb = n * saa - sa * sa, n * sbb - sb * sb
    den = math.sqrt(va * vb) if va > 0 and vb > 0 else 0.0
    return (n * sab - sa * sb) / den if den > 0 else 0.0


def rollout_correction(
    actor_log_prob: Tensor,
    rollout_log_prob: Tensor,
    *,
    mode: str = "bypass",
    is_level: str = "token",
    is_threshold: float | None = 2.0,
    rs_bounds: tuple[float, float] | None = (0.5, 2.0),
    mask: Tensor | None = None,
) -> Correction:
    r"""Importance weights and a rejection mask from trainer vs rollout log-probs.

    ``log rho = sg(actor_log_prob - rollout_log_prob)``, per element for
    ``is_level="token"``; for ``is_level="sequence"`` the log-ratio is summed over each row's
    valid elements (the sequence likelihood ratio) and broadcast back to the row.

    - weights: ``min(rho, is_threshold)`` (truncated IS; ``is_threshold=None`` leaves it
      untruncated).
    - rejection: an element is rejected when ``rho`` is outside ``rs_bounds = (lo, hi)``
      (``None``: no rejection); rejected and padded elements get weight 0 and mask 0. An
      all-rejected batch gives zero weights (never NaN).
    - ``mode="decoupled"``: ``actor_log_prob`` is the proximal (old) policy recomputed by the
      trainer; the PPO loss uses it as ``old_log_prob`` and multiplies by ``weights``.
    - ``mode="bypass"``: the PPO loss uses ``rollout_log_prob`` itself as ``old_log_prob``
      (no recompute), so its ratio already corrects the mismatch: ``weights`` are the
      rejection mask alone (1 kept, 0 rejected); the IS weight statistics are still reported.

    ``actor_log_prob`` and ``rollout_log_prob``: (B,) per sample (one diffusion step) or
    (B, T) per token / per step; ``mask`` (same shape) marks valid elements.

    Metrics: ``logprob_abs_diff_mean``, ``logprob_abs_diff_max``, ``k3_kl`` (mean of
    ``rho - 1 - log rho``, an estimate of KL(rollout || actor)), ``log_ppl_diff`` (mean over
    rows of the actor's minus the rollout's mean negative log-prob), ``pearson`` (correlation
    of the two log-probs), ``is_weight_mean``, ``is_truncated_frac``, ``rejected_frac``.
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"mode must be one of {CORRECTION_MODES}, got {mode!r}")
    if is_level not in ("token", "sequence"):
        raise ValueError(f"is_level must be 'token' or 'sequence', got {is_level!r}")
    if actor_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(
            f"actor_log_prob shape {tuple(actor_log_prob.shape)} != rollout_log_prob shape "
            f"{tuple(rollout_log_prob.shape)}"
        )
    if is_threshold is not None and not is_threshold > 0:
        raise ValueError(f"is_threshold must be > 0 or None, got {is_threshold}")
    if rs_bounds is not None:
        lo, hi = rs_bounds
        if not 0 <= lo < hi:
            raise ValueError(f"rs_bounds must be (lo, hi) with 0 <= lo < hi, got {rs_bounds}")
    dtype = torch.float64 if actor_log_prob.dtype == torch.float64 else torch.float32
    a = actor_log_prob.detach().to(dtype)
    r = rollout_log_prob.detach().to(device=a.device, dtype=dtype)
    if mask is not None and mask.shape != a.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != log_prob shape {tuple(a.shape)}")
    valid = torch.ones_like(a, dtype=torch.bool) if mask is None else mask.to(a.device).bool()
    vf = valid.to(dtype)
    log_ratio = (a - r) * vf
    if is_level == "sequence":
        rows = log_ratio.sum(dim=tuple(range(1, a.ndim))) if a.ndim > 1 else log_ratio
        log_ratio = rows.reshape(-1, *([1] * (a.ndim - 1))).expand_as(a)
    log_rho = torch.clamp(log_ratio, -20.0, 20.0)
    rho = torch.exp(log_rho)
    keep = valid.clone()
    if rs_bounds is not None:
        keep &= (rho >= rs_bounds[0]) & (rho <= rs_bounds[1])
    is_w = rho if is_threshold is None else torch.clamp(rho, max=is_threshold)
    keep_f = keep.to(dtype)
    weights = keep_f if mode == "bypass" else is_w * keep_f

    n_valid = float(vf.sum())

    def vmean(t: Tensor) -> float:
        return float((t * vf).sum()) / n_valid if n_valid > 0 else 0.0

    diff = (a - r).abs()
    tok_lr = a - r
    k3 = torch.exp(torch.clamp(tok_lr, -20, 20)) - 1 - tok_lr
    if a.ndim > 1:
        cnt = vf.sum(dim=tuple(range(1, a.ndim)))
        nz = cnt > 0
        a_ppl = -(a * vf).sum(dim=tuple(range(1, a.ndim))) / cnt.clamp(min=1)
        r_ppl = -(r * vf).sum(dim=tuple(range(1, a.ndim))) / cnt.clamp(min=1)
        log_ppl_diff = float((a_ppl - r_ppl)[nz].mean()) if bool(nz.any()) else 0.0
    else:
        log_ppl_diff = vmean(-(a - r))
    metrics = {
        "logprob_abs_diff_mean": vmean(diff),
        "logprob_abs_diff_max": float(diff[valid].max()) if n_valid > 0 else 0.0,
        "k3_kl": vmean(k3),
        "log_ppl_diff": log_ppl_diff,
        "pearson": pearson_from_sums(pearson_sums(a[valid], r[valid])),
        "is_weight_mean": vmean(is_w),
        "is_truncated_frac": vmean((rho > is_threshold).to(dtype))
        if is_threshold is not None
        else 0.0,
        "rejected_frac": vmean((~keep).to(dtype)),
    }
    for k, val in metrics.items():
        if not math.isfinite(val):
            metrics[k] = 0.0
    return Correction(weights.detach(), keep, metrics)
