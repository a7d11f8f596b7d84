"""`trainer.mode: async`: the rollout of step k+1 overlaps the update of step k.

Versions: the policy after the update of step k is version k + 1, so step j is trained by
policy version j. A batch rolled out on version v and trained at version j has staleness
j - v. The scheduler launches the rollout of step j as soon as

    j - (current policy version) <= max_staleness,

so every sample's staleness is at most `max_staleness` (0 = the synchronous schedule). With
`max_staleness: 1`, step k+1's rollout (on version k) runs while step k updates.

Stale samples are off-policy: the update recomputes the proximal log-probs under the current
weights and weights the loss with `omni_algos.correction.rollout_correction` (decoupled PPO,
Hilton et al. 2021, arXiv 2110.00641), or in `bypass` mode keeps the rollout log-probs as
the PPO anchor with the rejection mask only (`trainer.async_correction`).

Metrics per step: `async/staleness_max`, `async/staleness_mean` (of the samples trained),
`async/in_flight` (rollouts queued when the update started) and the correction statistics
`async/correction_*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import TrainError
from ..trainer import LocalTrainer, StepBatch
from .ray_backend import RayTrainer

__all__ = ["AsyncRayTrainer", "launchable", "staleness_stats"]


def launchable(next_step: int, version: int, max_staleness: int, total_steps: int) -> bool:
    """May the rollout of `next_step` start now, with the policy at `version`?"""
    return next_step < total_steps and next_step - version <= max_staleness


def staleness_stats(policy_version: int, sample_versions: list[int]) -> dict[str, float]:
    """Staleness (policy version at update minus the sample's rollout version)."""
    s = [policy_version - v for v in sample_versions]
    if any(x < 0 for x in s):
        raise TrainError(f"async: samples from a future policy version ({sample_versions})")
    return {"async/staleness_max": float(max(s)), "async/staleness_mean": sum(s) / len(s)}


@dataclass
class _Launched:
    batch: StepBatch
    handle: Any
    version: int


class AsyncRayTrainer(RayTrainer):
    """RayTrainer with rollouts launched ahead of the update, within `max_staleness`."""

    def setup(self) -> None:
        super().setup()
        self._launched: dict[int, _Launched] = {}
        self._next = 0

    @classmethod
    def adopt(cls, trainer: RayTrainer, recipe: Any | None = None) -> AsyncRayTrainer:
        """Take over the worker pools of a set-up `RayTrainer` (its weights, version and
        step), e.g. to switch a running job to async mode; `recipe` may change the
        `trainer.mode / max_staleness / steps` fields."""
        new = cls.__new__(cls)
        new.__dict__.update(trainer.__dict__)
        if recipe is not None:
            new.recipe = recipe
        trainer.actors, trainer.engine, trainer.reward = [], None, None
        trainer._own_ray = False
        new._launched = {}
        new._next = new.step
        return new

    def _launch_ready(self) -> None:
        t = self.recipe.trainer
        while launchable(self._next, self.version, t.max_staleness, t.steps):
            self.engine.defer = True
            try:
                batch = LocalTrainer.rollout(self, self._next)  # prompts, groups, seeds
            finally:
                self.engine.defer = False
            self._launched[self._next] = _Launched(batch, self.engine.deferred, self.version)
            self._next += 1

    def rollout(self, step: int) -> StepBatch:
        if self._next <= step:  # e.g. after a resume
            self._next = step
        self._launch_ready()
        item = self._launched.pop(step)
        item.batch.trajectories = item.handle.result()
        self._launch_ready()  # anything the current version now allows
        f = item.handle.forwards
        self.rollout_stats = {  # the launches saw none of it: report the collected rollout
            "rollout/forwards": f,
            "rollout/rows_per_forward": item.handle.rows / max(f, 1),
        }
        return item.batch

    def update(self, batch: StepBatch, step: int) -> dict[str, float]:
        t = self.recipe.trainer
        stats = staleness_stats(self.version, [int(x.version) for x in batch.trajectories])
        if stats["async/staleness_max"] > t.max_staleness:
            raise TrainError(
                f"async: step {step} samples are {stats['async/staleness_max']:g} versions old, "
                f"over trainer.max_staleness={t.max_staleness}"
            )
        self.correction = t.async_correction if stats["async/staleness_max"] > 0 else None
        try:
            metrics = super().update(batch, step)
        finally:
            self.correction = None
        metrics.update(stats)
        metrics["async/in_flight"] = float(len(self._launched))
        return metrics

    def sync_weights(self, version: int, full: bool = False) -> None:
        """Gather from the actors, push to the rollout actors without waiting: rollouts
        already queued finish on their version; those launched afterwards use this one."""
        self.engine.update_weights(self.gather_weights(full), version, wait=False)
        self.version = version
