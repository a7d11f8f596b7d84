"""DiffusionNFT: online RL on the forward (noising) process, no likelihoods needed."""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import as_float, check_same_shape, compute_dtype, expand_rows, mean_dims
from ._registry import LossOutput, register

__all__ = ["NFT_ADV_MODES", "diffusion_nft", "nft_reward_prob"]

NFT_ADV_MODES = ("continuous", "positive_only", "negative_only", "binary", "one_only")


def nft_reward_prob(
    advantages: Tensor, *, adv_clip_max: float = 5.0, adv_mode: str = "continuous"
) -> Tensor:
    r"""DiffusionNFT's optimality probability ``p = clamp(A' / (2c) + 1/2, 0, 1)``.

    ``A' = clip(A, -c, c)`` (``c = adv_clip_max``), then per ``adv_mode``:
    ``continuous`` keeps it, ``positive_only`` clamps to ``[0, c]``, ``negative_only`` to
    ``[-c, 0]``, ``binary`` takes ``sign(A')``, ``one_only`` maps ``A' > 0`` to 1 and the rest
    to 0.
    """
    if adv_mode not in NFT_ADV_MODES:
        raise ValueError(f"adv_mode must be one of {NFT_ADV_MODES}, got {adv_mode!r}")
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    a = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        a = a.clamp(min=0)
    elif adv_mode == "negative_only":
        a = a.clamp(max=0)
    elif adv_mode == "binary":
        a = torch.sign(a)
    elif adv_mode == "one_only":
        a = (a > 0).to(a.dtype)
    return torch.clamp(a / (2 * adv_clip_max) + 0.5, 0.0, 1.0)


@register("diffusion_nft")
def diffusion_nft(
    velocity: Tensor,
    old_velocity: Tensor,
    x_t: Tensor,
    x0: Tensor,
    t: Tensor | float,
    advantages: Tensor,
    *,
    ref_velocity: Tensor | None = None,
    beta: float = 1.0,
    adv_clip_max: float = 5.0,
    adv_mode: str = "continuous",
    w_min: float = 1e-5,
    kl_weight: float = 0.0,
    weights: Tensor | None = None,
) -> LossOutput:
    r"""DiffusionNFT loss (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement
    with Forward Process", arXiv 2509.16117).

    A clean sample ``x0`` with reward is re-noised, ``x_t = (1 - t) x0 + t eps``; the current
    velocity ``v`` and the frozen old (rollout) velocity ``v_old`` define an implicit
    positive and negative policy:

    ``v+ = beta v + (1 - beta) v_old``, ``v- = (1 + beta) v_old - beta v``,
    ``x0± = x_t - t v±``,
    ``L± = mean_dims (x0± - x0)^2 / sg(max(mean_dims |x0± - x0|, w_min))`` (adaptive weight),

    ``loss = c mean_b(w_b (p_b L+ + (1 - p_b) L-) / beta)
    + kl_weight mean_b mean_dims (v - v_ref)^2``

    with ``p = nft_reward_prob(A)`` and ``c = adv_clip_max``. ``t`` is a float or (B,);
    ``old_velocity``, ``ref_velocity`` are treated as constants. Metrics: ``policy_loss``,
    ``kl``, ``loss_pos``, ``loss_neg``, ``p_mean``.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    dtype = compute_dtype(velocity, old_velocity, x_t, x0)
    v = as_float(velocity, dtype)
    dev = v.device
    v_old = as_float(old_velocity, dtype, dev).detach()
    xt = as_float(x_t, dtype, dev).detach()
    x0_ = as_float(x0, dtype, dev).detach()
    for name, other in (("old_velocity", v_old), ("x_t", xt), ("x0", x0_)):
        check_same_shape("velocity", v, name, other)
    tt = as_float(t, dtype, dev).detach()
    if tt.ndim == 1:
        tt = tt.reshape(-1, *([1] * (v.ndim - 1)))
    adv = as_float(advantages, dtype, dev).detach()
    if adv.shape != (v.shape[0],):
        raise ValueError(f"advantages must have shape ({v.shape[0]},), got {tuple(adv.shape)}")
    p = nft_reward_prob(adv, adv_clip_max=adv_clip_max, adv_mode=adv_mode)

    v_pos = beta * v + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v
    x0_pos = xt - tt * v_pos
    x0_neg = xt - tt * v_neg
    w_pos = mean_dims((x0_pos.detach() - x0_).abs()).clamp(min=w_min)
    w_neg = mean_dims((x0_neg.detach() - x0_).abs()).clamp(min=w_min)
    l_pos = mean_dims((x0_pos - x0_) ** 2) / w_pos
    l_neg = mean_dims((x0_neg - x0_) ** 2) / w_neg
    per = adv_clip_max * (p * l_pos + (1 - p) * l_neg) / beta
    if weights is not None:
        per = per * expand_rows(as_float(weights, dtype, dev), per, "weights")
    policy = per.mean()
    kl = torch.zeros((), dtype=dtype, device=dev)
    if ref_velocity is not None:
        v_ref = as_float(ref_velocity, dtype, dev).detach()
        check_same_shape("velocity", v, "ref_velocity", v_ref)
        kl = mean_dims((v - v_ref) ** 2).mean()
    loss = policy + kl_weight * kl
    metrics = {
        "policy_loss": float(policy.detach()),
        "kl": float(kl.detach()),
        "loss_pos": float(l_pos.detach().mean()),
        "loss_neg": float(l_neg.detach().mean()),
        "p_mean": float(p.mean()),
    }
    return LossOutput(loss, metrics)
