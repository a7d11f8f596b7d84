"""Diffusion-DPO for flow matching, and the online pairing helper."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._common import as_float, check_same_shape, compute_dtype, mean_dims
from ._registry import LossOutput, register

__all__ = ["diffusion_dpo", "pair_by_reward"]


@register("diffusion_dpo")
def diffusion_dpo(
    velocity_w: Tensor,
    velocity_l: Tensor,
    ref_velocity_w: Tensor,
    ref_velocity_l: Tensor,
    x0_w: Tensor,
    x0_l: Tensor,
    noise: Tensor,
    *,
    beta: float = 2000.0,
) -> LossOutput:
    r"""Diffusion-DPO (Wallace et al. 2023, arXiv 2311.12908) in flow-matching form.

    A preferred (w) and rejected (l) sample share the noise ``eps`` and the timestep ``t``:
    ``x_t^{w,l} = (1 - t) x0^{w,l} + t eps``; the velocity target is ``eps - x0``. With
    ``e = mean_dims (v - (eps - x0))^2`` for the policy and ``e_ref`` for the frozen reference,

    ``loss = -mean log sigmoid(-beta/2 ((e_w - e_ref_w) - (e_l - e_ref_l)))``.

    Metrics: ``implicit_acc`` (fraction of pairs where the policy improves the winner more than
    the loser, i.e. the sigmoid argument > 0), ``model_diff`` (``e_w - e_l``), ``ref_diff``.
    """
    dtype = compute_dtype(velocity_w, velocity_l, x0_w, x0_l, noise)
    vw = as_float(velocity_w, dtype)
    dev = vw.device
    vl = as_float(velocity_l, dtype, dev)
    rw = as_float(ref_velocity_w, dtype, dev).detach()
    rl = as_float(ref_velocity_l, dtype, dev).detach()
    xw = as_float(x0_w, dtype, dev).detach()
    xl = as_float(x0_l, dtype, dev).detach()
    eps = as_float(noise, dtype, dev).detach()
    for name, other in (
        ("velocity_l", vl),
        ("ref_velocity_w", rw),
        ("ref_velocity_l", rl),
        ("x0_w", xw),
        ("x0_l", xl),
        ("noise", eps),
    ):
        check_same_shape("velocity_w", vw, name, other)
    tw, tl = eps - xw, eps - xl
    e_w = mean_dims((vw - tw) ** 2)
    e_l = mean_dims((vl - tl) ** 2)
    e_rw = mean_dims((rw - tw) ** 2)
    e_rl = mean_dims((rl - tl) ** 2)
    model_diff = e_w - e_l
    ref_diff = e_rw - e_rl
    inside = -0.5 * beta * (model_diff - ref_diff)
    loss = -F.logsigmoid(inside).mean()
    metrics = {
        "implicit_acc": float((inside.detach() > 0).float().mean()),
        "model_diff": float(model_diff.detach().mean()),
        "ref_diff": float(ref_diff.mean()),
        "mse_w": float(e_w.detach().mean()),
        "mse_l": float(e_l.detach().mean()),
    }
    return LossOutput(loss, metrics)


def pair_by_reward(
    rewards: Tensor | Sequence[float],
    group_ids: Tensor | Sequence[Any],
    per_group: int = 1,
) -> tuple[Tensor, Tensor]:
    """Online DPO pairs. Per group the rows are ranked by reward (highest first, ties in row
    order); the i-th best row is the winner and the i-th worst the loser of pair i, for
    i < ``per_group`` and i < half the group, kept when the winner's reward is strictly higher.
    ``per_group=1`` is the best vs the worst row (the argmax / argmin, first occurrence on
    ties). Groups with fewer than two rows or all-equal rewards give no pair. Returns
    ``(winner_idx, loser_idx)``, long tensors of shape (P,), pairs grouped in order of each
    group's first appearance. NaN/inf rewards raise ``ValueError``."""
    if per_group < 1:
        raise ValueError(f"per_group must be >= 1, got {per_group}")
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    bad = ~torch.isfinite(r)
    if bool(bad.any()):
        raise ValueError(
            f"rewards contain NaN or inf at rows {torch.nonzero(bad).flatten().tolist()}"
        )
    ids = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    if len(ids) != r.shape[0]:
        raise ValueError(f"group_ids has {len(ids)} entries but rewards has {r.shape[0]}")
    groups: dict[Any, list[int]] = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    win, lose = [], []
    for idx in groups.values():
        values = [float(r[i]) for i in idx]
        # stable sorts: among equal rewards the earlier row is both the "best" and the "worst"
        best = sorted(range(len(idx)), key=lambda j: -values[j])
        worst = sorted(range(len(idx)), key=lambda j: values[j])
        for i in range(min(per_group, len(idx) // 2)):
            hi, lo = best[i], worst[i]
            if values[hi] > values[lo]:
                win.append(idx[hi])
                lose.append(idx[lo])
    return torch.tensor(win, dtype=torch.long), torch.tensor(lose, dtype=torch.long)
