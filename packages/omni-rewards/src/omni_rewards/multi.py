"""`MultiReward`: a weighted sum of named rewards."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .base import Reward, RewardError, as_input
from .registry import load_reward
from .types import RewardInput, RewardOutput

__all__ = ["MultiReward"]


class MultiReward(Reward):
    """score_b = sum_i w_i * s_i,b over the rewards that succeeded.

    ``rewards`` maps a name to ``(reward, weight)`` or ``(reward, weight, required)``; a reward
    may be given by its registry name (built with `load_reward`). ``details[name]`` holds each
    reward's raw scores and ``details[f"{name}/{key}"]`` its details.

    A reward is required unless it is named in ``optional`` (or given ``required=False``
    in its tuple). A failing required reward raises. A failing optional reward gives NaN in
    ``details[name]``, is left out of the sum, warns, and is counted in
    ``metrics[f"reward/{name}/failures"]``.
    """

    name = "multi"

    def __init__(
        self,
        rewards: Mapping[str, tuple[Any, ...]],
        *,
        optional: Iterable[str] = (),
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, workers=workers)
        if not rewards:
            raise ValueError("rewards: MultiReward needs at least one reward")
        optional = set(optional)
        unknown = optional - set(rewards)
        if unknown:
            raise ValueError(f"optional: names {sorted(unknown)} are not among the rewards")
        self.rewards: dict[str, Reward] = {}
        self.weights: dict[str, float] = {}
        self.required: dict[str, bool] = {}
        for key, spec in rewards.items():
            if not isinstance(spec, tuple | list) or len(spec) not in (2, 3):
                raise ValueError(
                    f"rewards[{key!r}]: expected (reward, weight[, required]), got {spec!r}"
                )
            reward, weight = spec[0], float(spec[1])
            if not np.isfinite(weight):
                raise ValueError(f"rewards[{key!r}]: weight must be finite, got {weight}")
            if isinstance(reward, str):
                reward = load_reward(reward)
            self.rewards[key] = reward
            self.weights[key] = weight
            self.required[key] = bool(spec[2]) if len(spec) == 3 else key not in optional
        self.metrics: dict[str, float] = {f"reward/{k}/failures": 0 for k in self.rewards}

    def _combine(
        self, inp: RewardInput, results: dict[str, RewardOutput | BaseException]
    ) -> RewardOutput:
        n = inp.batch_size
        total = np.zeros(n, dtype=np.float64)
        details: dict[str, np.ndarray] = {}
        for key, res in results.items():
            if isinstance(res, BaseException):
                if self.required[key]:
                    raise RewardError(f"required reward {key!r} failed: {res}") from res
                self.metrics[f"reward/{key}/failures"] += 1
                warnings.warn(
                    f"optional reward {key!r} failed and is left out of the sum: {res}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                details[key] = np.full(n, np.nan, dtype=np.float32)
                continue
            total += self.weights[key] * res.scores.astype(np.float64)
            details[key] = res.scores
            for dk, dv in res.details.items():
                details[f"{key}/{dk}"] = dv
        return RewardOutput(total.astype(np.float32), details)

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        results: dict[str, RewardOutput | BaseException] = {}
        for key, reward in self.rewards.items():
            try:
                results[key] = reward(inp)
            except Exception as e:
                results[key] = e
        return self._combine(inp, results)

    async def ascore(self, inp: RewardInput | dict | None = None, /, **fields: Any) -> RewardOutput:
        """Scores every reward concurrently (each in its own worker) and combines them."""
        inp = as_input(inp, **fields)
        outs = await asyncio.gather(
            *(r.ascore(inp) for r in self.rewards.values()), return_exceptions=True
        )
        return self._combine(inp, dict(zip(self.rewards, outs)))

    def close(self) -> None:
        for r in self.rewards.values():
            r.close()
        super().close()
