"""omni_algos: the math of RL post-training for diffusion and omni models.

SDE steps with log-probs (:mod:`omni_algos.sde`), group advantages
(:mod:`omni_algos.advantages`), losses (:mod:`omni_algos.losses`) and rollout correction
(:mod:`omni_algos.correction`). Pure torch.
"""

from . import advantages, correction, losses, ode, sde
from .advantages import (
    ADVANTAGES,
    dr_grpo_advantages,
    group_advantages,
    group_stats,
    rloo_advantages,
)
from .correction import Correction, rollout_correction
from .losses import (
    LOSSES,
    LossOutput,
    agg_loss,
    dance_grpo,
    diffusion_dpo,
    diffusion_nft,
    flow_dppo,
    flow_grpo,
    grpo,
    grpo_guard,
    gspo,
    k3_kl,
    kl_penalty,
    mix_grpo,
    nft_reward_prob,
    pair_by_reward,
    register,
)
from .ode import dpm_solver_2m_step
from .sde import SDE_KINDS, SDEStep, mix_grpo_window, sample_windows, step

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "SDE_KINDS",
    "Correction",
    "LossOutput",
    "SDEStep",
    "advantages",
    "agg_loss",
    "correction",
    "dance_grpo",
    "diffusion_dpo",
    "diffusion_nft",
    "dpm_solver_2m_step",
    "dr_grpo_advantages",
    "flow_dppo",
    "flow_grpo",
    "group_advantages",
    "group_stats",
    "grpo",
    "grpo_guard",
    "gspo",
    "k3_kl",
    "kl_penalty",
    "losses",
    "mix_grpo",
    "mix_grpo_window",
    "nft_reward_prob",
    "ode",
    "pair_by_reward",
    "register",
    "rloo_advantages",
    "rollout_correction",
    "sample_windows",
    "sde",
    "step",
]
