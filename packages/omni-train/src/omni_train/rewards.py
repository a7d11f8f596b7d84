"""The recipe's reward: one `omni_rewards.load_reward` or a weighted `MultiReward`."""

from __future__ import annotations

import re
from typing import Any

from .errors import TrainError
from .recipe import Recipe

__all__ = ["build_reward"]


def build_reward(recipe: Recipe) -> Any:
    """`reward.name` (+ `options`) or `reward.terms`, with errors naming the recipe key."""
    import omni_rewards

    def one(name: str, options: dict[str, Any], key: str) -> Any:
        try:
            return omni_rewards.load_reward(name, **options)
        except omni_rewards.MissingDependencyError as exc:
            raise TrainError(f"{key}: {exc}") from None
        except KeyError as exc:
            raise TrainError(f"{key}: {exc.args[0] if exc.args else exc}") from None
        except TypeError as exc:
            bad = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
            if bad:
                opts = key.removesuffix(".name") + ".options"
                raise TrainError(
                    f"{opts}: reward {name!r} has no option {bad.group(1)!r}"
                ) from None
            raise TrainError(f"{key} / options: {exc}") from None
        except (ValueError, FileNotFoundError) as exc:
            raise TrainError(f"{key} / options: {exc}") from None

    r = recipe.reward
    if r.name is not None:
        return one(r.name, dict(r.options), "reward.name")
    terms: dict[str, tuple[Any, float]] = {}
    for i, t in enumerate(r.terms or []):
        key = t.name if t.name not in terms else f"{t.name}_{i}"
        terms[key] = (one(t.name, dict(t.options), f"reward.terms[{i}].name"), t.weight)
    return omni_rewards.MultiReward(terms)
