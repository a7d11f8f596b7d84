"""The algorithm table: what each `algorithm.name` trains, with which loss and inputs, where.

Every name a recipe may put in `algorithm.name` has one row here. The trainer reads the row
instead of inspecting loss signatures, and `Recipe.check` / `omni-train validate` read it to
refuse, by key, every combination a backend or mode does not run. So a recipe that validates
runs.

Three update kinds (`omni_train.updates`), one implementation each:

- ``sde_replay``: the FlowGRPO family. The trainer recomputes the velocity at each stored SDE
  window step under the current weights, `omni_algos.sde.step(..., prev_sample=stored)` gives
  the new log-prob, and a clipped policy-gradient loss compares it with the rollout's.
- ``forward_process``: DiffusionNFT and online Diffusion-DPO. The clean final latents are
  noised again, ``x_t = (1 - t) x0 + t eps``, and the loss compares velocities (no log-probs).
- ``token``: GSPO / GRPO on an autoregressive thinker's sampled tokens.

``loss_inputs`` names what the update passes to the loss beyond the kind's core inputs (as
verl-omni's losses declare their ``required_*_keys``):

- ``clip_range``, ``adv_clip_max``: the recipe's `algorithm.clip_range` / `adv_clip_max`
  (when set; a token loss takes `clip_range` as its ``clip_low`` and ``clip_high``:
  `omni_train.updates.token.token_loss_options`);
- ``mean``: the step's Gaussian mean under the current weights and under the rollout weights
  (``mean``, ``old_mean``; the latter from one no-grad replay before the first optimizer step);
- ``std``: the per-row step std and ``sqrt(-dt)`` (``std``, ``sqrt_dt``);
- ``std_mean``: ``std`` and ``sqrt_dt`` as their means over the whole minibatch (floats), for
  losses that normalise by batch statistics: a minibatch split over ranks or micro-batches
  then gives the loss the same numbers as one undivided pass;
- ``weights``: per-sample weights (rollout correction, stale samples in async mode);
- ``adv_clip_max`` for the forward-process kind, ``mask`` for the token kind.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALGORITHMS", "UPDATE_KINDS", "Algorithm", "algorithm"]

#: the update kinds of `omni_train.updates`
UPDATE_KINDS = ("sde_replay", "forward_process", "token")

_DIFFUSION_KINDS = ("sde", "cps", "dance")


@dataclass(frozen=True)
class Algorithm:
    """One row of the algorithm table."""

    name: str
    #: `UPDATE_KINDS` entry: which update step trains it
    kind: str
    #: the loss, a key of `omni_algos.losses.LOSSES`
    loss: str
    #: inputs the update passes to the loss beyond the kind's core inputs (module docstring)
    loss_inputs: tuple[str, ...]
    #: "diffusion" or "omni" (which loop runs it)
    model: str
    #: `trainer.backend` values that run it
    backends: tuple[str, ...]
    #: `trainer.mode` values that run it
    modes: tuple[str, ...] = ("sync",)
    #: SDE kinds (`rollout.sde_kind`) its log-probs are defined for (sde_replay only)
    sde_kinds: tuple[str, ...] = _DIFFUSION_KINDS
    #: "per_sample": each sample's window is drawn from its own seed in
    #: `rollout.sde_window_range`; "mix_grpo": one sliding window per training step
    #: (`omni_algos.sde.mix_grpo_window`)
    window: str = "per_sample"
    #: forward_process only: the batch is preference pairs (best vs worst of each group)
    pairs: bool = False
    #: token only: the loss's default aggregation (`omni_algos.losses.agg_loss`)
    token_agg: str = "token-mean"
    #: the paper
    reference: str = ""

    @property
    def takes_weights(self) -> bool:
        """Per-sample weights: rollout correction and async mode need them."""
        return "weights" in self.loss_inputs


_FLOW = ("clip_range", "adv_clip_max", "weights")

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "flow_grpo",
            "sde_replay",
            "flow_grpo",
            _FLOW,
            "diffusion",
            ("local", "ray"),
            ("sync", "async"),
            reference="Liu et al. 2025, Flow-GRPO, arXiv 2505.05470",
        ),
        Algorithm(
            "dance_grpo",
            "sde_replay",
            "flow_grpo",  # the same clipped objective on the DanceGRPO SDE's log-probs
            _FLOW,
            "diffusion",
            ("local", "ray"),
            ("sync", "async"),
            sde_kinds=("dance",),
            reference="Xue et al. 2025, DanceGRPO, arXiv 2505.07818",
        ),
        Algorithm(
            "mix_grpo",
            "sde_replay",
            "flow_grpo",  # GRPO's clipped objective over the sliding window's SDE steps
            _FLOW,
            "diffusion",
            ("local", "ray"),
            ("sync", "async"),
            window="mix_grpo",
            reference="Li et al. 2025, MixGRPO, arXiv 2507.21802",
        ),
        Algorithm(
            "flow_dppo",
            "sde_replay",
            "flow_dppo",
            ("mean", "std", "weights"),
            "diffusion",
            ("local", "ray"),
            ("sync", "async"),
            reference="Flow-DPPO: divergence-masked policy gradient (omni_algos.losses.flow)",
        ),
        Algorithm(
            "grpo_guard",
            "sde_replay",
            "grpo_guard",
            ("mean", "std_mean", "clip_range", "adv_clip_max", "weights"),
            "diffusion",
            ("local", "ray"),
            ("sync", "async"),
            reference="Wang et al. 2025, GRPO-Guard, arXiv 2510.22319",
        ),
        Algorithm(
            "diffusion_nft",
            "forward_process",
            "diffusion_nft",
            ("adv_clip_max",),
            "diffusion",
            ("local", "ray"),
            reference="Zheng et al. 2025, DiffusionNFT, arXiv 2509.16117",
        ),
        Algorithm(
            "diffusion_dpo",
            "forward_process",
            "diffusion_dpo",
            (),
            "diffusion",
            ("local", "ray"),
            pairs=True,
            reference="Wallace et al. 2023, Diffusion-DPO, arXiv 2311.12908 (online pairs)",
        ),
        Algorithm(
            "gspo",
            "token",
            "gspo",
            ("mask", "clip_range"),
            "omni",
            ("local", "ray", "verl"),
            token_agg="seq-mean-token-mean",
            reference="Zheng et al. 2025, GSPO, arXiv 2507.18071",
        ),
        Algorithm(
            "grpo",
            "token",
            "grpo",
            ("mask", "clip_range"),
            "omni",
            ("local", "ray", "verl"),
            token_agg="token-mean",
            reference="Shao et al. 2024, DeepSeekMath (GRPO), arXiv 2402.03300",
        ),
    )
}


def algorithm(name: str) -> Algorithm:
    """The table row of `name`; KeyError (with the known names) when there is none."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        known = ", ".join(sorted(ALGORITHMS))
        raise KeyError(f"unknown algorithm {name!r}; known: {known}") from None
