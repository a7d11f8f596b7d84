"""Group-relative advantage estimators (GRPO family).

Every estimator takes ``rewards`` (B,) and ``group_ids`` (B,) (a tensor of ints or any list
of hashables, e.g. prompts) and returns float32 advantages of shape (B,).

The arithmetic runs in float64 on the CPU whatever the input's dtype and device, and only the
result is rounded back. Why: in float32 the mean of a group of equal rewards such as
``[1.8047759831677865] * 3`` is off by one ulp (~1e-7), and divided by ``std + eps`` (1e-4) that
noise becomes an advantage of ~1e-3 where the exact answer is 0; near-equal large rewards
(``[21.8359375, 21.8359375, 21.836803]``) lose 2e-3 the same way. In float64 the same error is
~1e-12, below float32's resolution of the result. The CPU because some accelerators (MPS) have
no float64; a (B,) vector costs nothing to move, and the estimators already synchronise to
check for NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ADVANTAGES",
    "dr_grpo_advantages",
    "group_advantages",
    "group_stats",
    "rloo_advantages",
]

GroupIds = Tensor | Sequence[Any]


def _as_rewards(rewards: Tensor | Sequence[float]) -> tuple[Tensor, torch.dtype, torch.device]:
    """The rewards as a float64 CPU working copy, and the dtype and device of the result
    (float64 for float64 rewards, else float32; the input's device)."""
    r = torch.as_tensor(rewards)
    if r.ndim != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(r.shape)}")
    out_dtype = torch.float64 if r.dtype == torch.float64 else torch.float32
    # A float32 tensor is widened exactly; a Python list is first rounded to float32, so that a
    # list and the tensor made from it give the same advantages.
    device = r.device
    r = r.to(out_dtype).to("cpu", torch.float64)
    bad = ~torch.isfinite(r)
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten().tolist()
        raise ValueError(f"rewards contain NaN or inf at rows {rows}: {r[bad].tolist()}")
    return r, out_dtype, device


def _inverse(group_ids: GroupIds, n: int, device) -> tuple[Tensor, int]:
    """Map group ids to dense indices 0..G-1 (first-seen order)."""
    if isinstance(group_ids, Tensor):
        if group_ids.ndim != 1 or group_ids.shape[0] != n:
            raise ValueError(
                f"group_ids must have shape ({n},) to match rewards, got {tuple(group_ids.shape)}"
            )
        _, inv = torch.unique(group_ids, return_inverse=True)
        return inv.to(device), int(inv.max().item()) + 1 if n else 0
    ids = list(group_ids)
    if len(ids) != n:
        raise ValueError(f"group_ids has {len(ids)} entries but rewards has {n}")
    seen: dict[Any, int] = {}
    inv_list = [seen.setdefault(g, len(seen)) for g in ids]
    return torch.tensor(inv_list, dtype=torch.long, device=device), len(seen)


def _group_moments(r: Tensor, inv: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group count, mean and unbiased std (NaN for singletons), each (G,)."""
    count = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(
        0, inv, torch.ones_like(r)
    )
    total = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, inv, r)
    mean = total / count
    sq = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(
        0, inv, (r - mean[inv]) ** 2
    )
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.full_like(sq, float("nan")))
    return count, mean, var.sqrt()


def group_advantages(
    rewards: Tensor | Sequence[float],
    group_ids: GroupIds,
    *,
    std: str = "global",
    eps: float = 1e-4,
) -> Tensor:
    r"""GRPO group-relative advantages: ``A_i = (r_i - mean_{g(i)}) / (std + eps)``.

    GRPO (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300); Flow-GRPO (arXiv 2505.05470)
    uses the ``"global"`` std. ``std`` selects the denominator:

    - ``"group"``: the unbiased std (``torch.std``, correction 1) of the row's own group;
    - ``"global"``: the unbiased std of all rewards in the batch;
    - ``"none"``: no scaling (``A_i = r_i - mean_g``, Dr. GRPO).

    Rows in singleton groups get 0. NaN or inf rewards raise a ``ValueError`` naming the
    rows. Computed in float64; returns float32 (float64 for float64 rewards), shape (B,), on the
    rewards' device.
    """
    if std not in ("global", "group", "none"):
        raise ValueError(f"std must be 'global', 'group' or 'none', got {std!r}")
    r, out_dtype, device = _as_rewards(rewards)
    n = r.shape[0]
    if n == 0:
        return r.to(device, out_dtype)
    inv, num_groups = _inverse(group_ids, n, r.device)
    count, mean, gstd = _group_moments(r, inv, num_groups)
    centered = r - mean[inv]
    if std == "group":
        adv = centered / (gstd[inv] + eps)
    elif std == "global":
        gl = r.std() if n > 1 else torch.zeros((), dtype=r.dtype, device=r.device)
        adv = centered / (gl + eps)
    else:
        adv = centered
    singleton = count[inv] <= 1
    return torch.where(singleton, torch.zeros_like(adv), adv).to(device, out_dtype)


def dr_grpo_advantages(rewards: Tensor | Sequence[float], group_ids: GroupIds, **_: Any) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): ``A_i = r_i - mean_{g(i)}``, no std."""
    return group_advantages(rewards, group_ids, std="none")


def rloo_advantages(rewards: Tensor | Sequence[float], group_ids: GroupIds, **_: Any) -> Tensor:
    r"""RLOO (Ahmadian et al. 2024, arXiv 2402.14740): leave-one-out baseline,
    ``A_i = r_i - (sum_g r - r_i) / (n_g - 1) = n_g / (n_g - 1) (r_i - mean_g)``.
    Singleton groups give 0. Computed in float64 like ``group_advantages``."""
    r, out_dtype, device = _as_rewards(rewards)
    n = r.shape[0]
    if n == 0:
        return r.to(device, out_dtype)
    inv, num_groups = _inverse(group_ids, n, r.device)
    count, mean, _ = _group_moments(r, inv, num_groups)
    c = count[inv]
    adv = (r - mean[inv]) * c / (c - 1).clamp(min=1)
    return torch.where(c <= 1, torch.zeros_like(adv), adv).to(device, out_dtype)


def group_stats(rewards: Tensor | Sequence[float], group_ids: GroupIds) -> dict[str, float]:
    """Per-group reward statistics as metrics.

    - ``zero_std_ratio``: fraction of groups whose rewards are all equal (std 0; singletons
      count as zero-std: they carry no learning signal);
    - ``std_mean``: mean over groups of the unbiased group std (singletons count 0);
    - ``num_groups``, ``group_size_mean``.
    """
    r, _, _ = _as_rewards(rewards)
    if r.shape[0] == 0:
        return {"zero_std_ratio": 0.0, "std_mean": 0.0, "num_groups": 0.0, "group_size_mean": 0.0}
    inv, num_groups = _inverse(group_ids, r.shape[0], r.device)
    count, _, gstd = _group_moments(r, inv, num_groups)
    gstd = torch.nan_to_num(gstd, nan=0.0)
    return {
        "zero_std_ratio": float((gstd == 0).float().mean()),
        "std_mean": float(gstd.mean()),
        "num_groups": float(num_groups),
        "group_size_mean": float(count.mean()),
    }


ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": group_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}
