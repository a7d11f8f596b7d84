"""Small helpers shared by the losses (dtype promotion, broadcasting, metrics)."""

from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """``max(float32, input dtypes)``: half/bfloat16 become float32, float64 stays float64."""
    dtype = torch.float32
    for t in tensors:
        if isinstance(t, Tensor) and t.dtype == torch.float64:
            dtype = torch.float64
    return dtype


def as_float(t: Tensor | float | None, dtype: torch.dtype, device=None) -> Tensor | None:
    if t is None:
        return None
    if isinstance(t, Tensor):
        return t.to(dtype=dtype, device=device if device is not None else t.device)
    return torch.as_tensor(t, dtype=dtype, device=device)


def expand_rows(a: Tensor, like: Tensor, name: str) -> Tensor:
    """Broadcast a per-row tensor (B,) (or any shape that is a prefix of ``like``) to ``like``."""
    if a.shape == like.shape:
        return a
    if a.ndim == 0:
        return a.expand_as(like)
    if a.ndim > like.ndim or tuple(a.shape) != tuple(like.shape[: a.ndim]):
        raise ValueError(
            f"{name} has shape {tuple(a.shape)}, which does not match log_prob shape "
            f"{tuple(like.shape)} (expected the same shape or a leading prefix such as (B,))"
        )
    return a.reshape(*a.shape, *([1] * (like.ndim - a.ndim))).expand_as(like)


def check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} shape {tuple(a.shape)} != {name_b} shape {tuple(b.shape)}")


def weighted_mean(per: Tensor, weights: Tensor | None) -> Tensor:
    """``mean(weights * per)`` (plain mean without weights)."""
    if weights is None:
        return per.mean()
    return (expand_rows(weights.to(per.dtype), per, "weights") * per).mean()


def std0(t: Tensor) -> float:
    return float(t.std()) if t.numel() > 1 else 0.0


def mean_dims(t: Tensor) -> Tensor:
    """Mean over every non-batch dim: (B, ...) -> (B,)."""
    return t.mean(dim=tuple(range(1, t.ndim))) if t.ndim > 1 else t


def spread_metrics(name: str, r: Tensor) -> dict[str, float]:
    """``{name}_mean``, ``{name}_std`` and ``{name}_dev_sq_mean = mean((r - 1)^2)`` of a ratio.

    A caller that splits a batch into pieces (micro-batches, data-parallel ranks) gets the
    whole batch's population std from the pieces' element-weighted means:
    ``std^2 = dev_sq_mean - (mean - 1)^2``; the pieces' own stds do not combine (a one-row
    piece's is 0). Deviations from 1 keep the difference exact in float32 near r = 1."""
    r = r.detach()
    if r.numel() == 0:
        return {f"{name}_mean": 1.0, f"{name}_std": 0.0, f"{name}_dev_sq_mean": 0.0}
    return {
        f"{name}_mean": float(r.mean()),
        f"{name}_std": std0(r),
        f"{name}_dev_sq_mean": float(((r - 1.0) ** 2).mean()),
    }


def ratio_metrics(
    ratio: Tensor, log_ratio: Tensor, clip_low: float, clip_high: float, mask: Tensor | None = None
) -> dict[str, float]:
    """ratio_mean, ratio_std, ratio_dev_sq_mean (`spread_metrics`), clipfrac (and its
    higher/lower parts), approx_kl.

    ``approx_kl = 0.5 mean((lp - lp_old)^2)`` (the estimator Flow-GRPO logs).
    """
    r = ratio.detach()
    lr = log_ratio.detach()
    if mask is not None:
        m = mask.bool()
        r, lr = r[m], lr[m]
    if r.numel() == 0:
        return {
            **spread_metrics("ratio", r),
            "clipfrac": 0.0,
            "clipfrac_higher": 0.0,
            "clipfrac_lower": 0.0,
            "approx_kl": 0.0,
        }
    hi = (r - 1.0 > clip_high).float().mean()
    lo = (1.0 - r > clip_low).float().mean()
    return {
        **spread_metrics("ratio", r),
        "clipfrac": float(hi + lo),
        "clipfrac_higher": float(hi),
        "clipfrac_lower": float(lo),
        "approx_kl": float(0.5 * (lr**2).mean()),
    }
