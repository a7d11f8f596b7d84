"""RL losses. Each returns ``LossOutput(loss, metrics)``; all are registered in ``LOSSES``.

Third parties add their own with ``@register("name")``.
"""

from ._registry import LOSSES, LossOutput, register
from .dpo import diffusion_dpo, pair_by_reward
from .flow import dance_grpo, flow_dppo, flow_grpo, grpo_guard, kl_penalty, mix_grpo
from .nft import NFT_ADV_MODES, diffusion_nft, nft_reward_prob
from .token import AGG_MODES, agg_loss, grpo, gspo, k3_kl

__all__ = [
    "AGG_MODES",
    "LOSSES",
    "NFT_ADV_MODES",
    "LossOutput",
    "agg_loss",
    "dance_grpo",
    "diffusion_dpo",
    "diffusion_nft",
    "flow_dppo",
    "flow_grpo",
    "grpo",
    "grpo_guard",
    "gspo",
    "k3_kl",
    "kl_penalty",
    "mix_grpo",
    "nft_reward_prob",
    "pair_by_reward",
    "register",
]
