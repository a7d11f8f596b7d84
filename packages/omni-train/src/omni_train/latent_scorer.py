"""Fit the latent reward model a recipe trains against, from the policy's own rollouts.

`reward.name: latent` scores clean latents with a small scorer (`omni_rewards.latent`), so
training needs no VAE decode. The scorer must exist first. With `reward.distill` set and
`reward.options.path` missing, `ensure_latent_scorer` makes it: it rolls out
`distill.samples` samples of the recipe's own model and prompts (seeds from the run seed, so
the same recipe makes the same scorer), decodes them once, scores them with the teacher (any
image reward) and fits the scorer with `omni_rewards.latent.distill_latent` (MSE plus a
pairwise ranking loss). The held-out Spearman correlation against the teacher goes to the
console and to `report.json` next to the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import TrainError
from .recipe import Recipe
from .seeds import DOMAIN_DISTILL, derive_seed

__all__ = ["ensure_latent_scorer"]


def ensure_latent_scorer(recipe: Recipe, engine: Any, params: Any, prompts: list[str]) -> None:
    """Distil the scorer at `reward.options.path` if the recipe asks and it is missing."""
    from diffusion_rollout import RolloutRequest
    from omni_rewards import MissingDependencyError, load_reward
    from omni_rewards.latent import distill_latent, save_scorer

    rw = recipe.reward
    if rw.name != "latent" or rw.distill is None:
        return
    path = rw.options.get("path")
    if not isinstance(path, str):
        raise TrainError("reward.options.path: the latent scorer's folder (a string) is required")
    out = Path(path).expanduser()
    if (out / "config.json").is_file():
        return
    d = rw.distill
    try:
        teacher = load_reward(d.teacher, **d.teacher_options)
    except MissingDependencyError as exc:
        raise TrainError(f"reward.distill.teacher: {exc}") from None
    except KeyError as exc:
        raise TrainError(f"reward.distill.teacher: {exc.args[0]}") from None
    reqs = [
        RolloutRequest(
            prompt=prompts[i % len(prompts)],
            seed=derive_seed(recipe.trainer.seed, 0, i, DOMAIN_DISTILL),
            params=params,
            request_id=f"distill-{i}",
        )
        for i in range(d.samples)
    ]
    print(f"reward.distill: {d.samples} rollouts for the latent scorer (teacher {d.teacher})")
    trajs = engine.generate_many(reqs)
    latents = torch.stack([t.final_latent for t in trajs]).float().numpy()
    images = torch.stack([t.media for t in trajs]).numpy()
    model, cfg, report = distill_latent(
        teacher,
        latents,
        images,
        prompts=[r.prompt for r in reqs],
        steps=d.steps,
        batch_size=d.batch_size,
        seed=recipe.trainer.seed,
        teacher_name=d.teacher,
    )
    save_scorer(model, cfg, out, report)
    print(
        f"reward.distill: scorer saved to {out}; held-out Spearman vs {d.teacher} "
        f"{report['spearman']:.3f}, pairwise accuracy {report['pairwise_accuracy']:.3f} "
        f"({report['heldout_pairs']} pairs)"
    )
    if not np.isfinite(report["spearman"]):
        raise TrainError(
            f"reward.distill: the teacher {d.teacher!r} gave constant scores on the rollouts; "
            "nothing to distil"
        )
