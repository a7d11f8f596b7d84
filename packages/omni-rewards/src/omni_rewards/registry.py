"""The reward registry (a dict) and `load_reward`.

Built-in model-backed rewards are registered as lazy factories, so importing omni_rewards
never imports torch, onnxruntime or transformers. Third-party rewards register through the
``omni_rewards.rewards`` entry-point group::

    [project.entry-points."omni_rewards.rewards"]
    my_reward = "my_pkg.rewards:MyReward"   # a Reward subclass or a factory(**options)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib import metadata
from typing import Any

from .base import Reward

__all__ = ["ENTRY_POINT_GROUP", "REWARDS", "available_rewards", "load_reward", "register"]

ENTRY_POINT_GROUP = "omni_rewards.rewards"

#: name -> factory(**options) returning a Reward.
REWARDS: dict[str, Callable[..., Reward]] = {}


def register(name: str) -> Callable[[Callable[..., Reward]], Callable[..., Reward]]:
    """Decorator: ``@register("my_reward")`` on a Reward subclass or factory function."""

    def deco(factory: Callable[..., Reward]) -> Callable[..., Reward]:
        REWARDS[name] = factory
        return factory

    return deco


def _lazy(module: str, attr: str) -> Callable[..., Reward]:
    def factory(**options: Any) -> Reward:
        cls = getattr(importlib.import_module(module, __package__), attr)
        return cls(**options)

    factory.__name__ = f"lazy_{attr}"
    factory.__qualname__ = factory.__name__
    factory.__doc__ = f"Builds {module}.{attr} (imported on first use)."
    return factory


_BUILTIN_LAZY = {
    "ocr": (".ocr", "OCRReward"),
    "clip_score": (".clip", "CLIPScoreReward"),
    "pickscore": (".clip", "PickScoreReward"),
    "hpsv2": (".clip", "HPSv2Reward"),
    "aesthetic": (".clip", "AestheticReward"),
    "clap": (".clap", "CLAPReward"),
    "imagebind": (".imagebind", "ImageBindReward"),
    "dina_lrm": (".dina_lrm", "DiNaLRMReward"),
    "latent": (".latent", "LatentReward"),
    "math": (".math", "MathReward"),
    "choice": (".math", "ChoiceReward"),
    "vlm_judge": (".vlm_judge", "VLMJudgeReward"),
    "http": (".http", "HTTPReward"),
    "shapes": (".shapes", "ShapesReward"),
}
for _name, (_mod, _attr) in _BUILTIN_LAZY.items():
    REWARDS.setdefault(_name, _lazy(_mod, _attr))


def _entry_points() -> dict[str, metadata.EntryPoint]:
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except TypeError:  # pragma: no cover - python < 3.10 API
        eps = metadata.entry_points().get(ENTRY_POINT_GROUP, [])
    return {ep.name: ep for ep in eps}


def available_rewards() -> list[str]:
    """Built-in and entry-point reward names."""
    return sorted(set(REWARDS) | set(_entry_points()))


def load_reward(name: str, **options: Any) -> Reward:
    """Build the reward registered as ``name`` with ``options`` (e.g. ``batch_size=8``).

    Looks in `REWARDS` first, then in the ``omni_rewards.rewards`` entry points. An unknown
    name raises `KeyError` listing the known ones.
    """
    factory = REWARDS.get(name)
    if factory is None:
        ep = _entry_points().get(name)
        if ep is None:
            raise KeyError(
                f"unknown reward {name!r}; known rewards: {', '.join(available_rewards())}"
            )
        factory = ep.load()
    reward = factory(**options)
    if not callable(reward) or not hasattr(reward, "ascore"):
        raise TypeError(
            f"reward {name!r}: factory returned {type(reward).__name__}, which has no "
            "__call__/ascore (subclass omni_rewards.Reward)"
        )
    return reward
