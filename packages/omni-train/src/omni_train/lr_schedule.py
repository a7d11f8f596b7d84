"""The learning rate of each training step (`optimizer.scheduler`).

With base rate ``lr``, ``W = warmup_steps``, ``T = trainer.steps`` and training step ``s``
(from 0), the rate for all of step s's optimizer steps is

- warmup (``s < W``): ``lr (s + 1) / W``;
- then, with ``p = (s - W) / max(T - W - 1, 1)`` in [0, 1] and ``m = min_lr_ratio``:
  ``constant``: ``lr``; ``linear``: ``lr (1 - (1 - m) p)``;
  ``cosine``: ``lr (m + (1 - m) (1 + cos(pi p)) / 2)``.

It depends on the step alone, so a resumed run (and every FSDP rank) computes the same rate.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["apply_learning_rate", "learning_rate"]


def learning_rate(recipe: Any, step: int) -> float:
    """The learning rate of training step ``step`` (module docstring)."""
    o = recipe.optimizer
    sch = o.scheduler
    w, total = sch.warmup_steps, recipe.trainer.steps
    if step < w:
        return o.lr * (step + 1) / w
    p = min(1.0, max(0.0, (step - w) / max(total - w - 1, 1)))
    m = sch.min_lr_ratio
    if sch.name == "linear":
        return o.lr * (1.0 - (1.0 - m) * p)
    if sch.name == "cosine":
        return o.lr * (m + (1.0 - m) * (1.0 + math.cos(math.pi * p)) / 2.0)
    return o.lr


def apply_learning_rate(optimizer: torch.optim.Optimizer, recipe: Any, step: int) -> float:
    """Set ``optimizer``'s rate for training step ``step``; returns it."""
    lr = learning_rate(recipe, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
