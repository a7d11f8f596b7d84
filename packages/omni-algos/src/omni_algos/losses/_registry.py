"""The loss registry and the loss result type."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from torch import Tensor

__all__ = ["LOSSES", "LossOutput", "register"]


@dataclass
class LossOutput:
    """A scalar loss to call ``backward()`` on, and detached metrics as Python floats."""

    loss: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


LOSSES: dict[str, Callable[..., LossOutput]] = {}

F = TypeVar("F", bound=Callable[..., LossOutput])


def _same(a: Callable, b: Callable) -> bool:
    if a is b:
        return True
    return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == (
        getattr(b, "__module__", None),
        getattr(b, "__qualname__", None),
    )


def register(name: str) -> Callable[[F], F]:
    """Decorator that adds a loss to :data:`LOSSES` under ``name``.

    Registering the same function again is a no-op; registering a different function under a
    taken name raises ``ValueError``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"loss name must be a non-empty string, got {name!r}")

    def deco(fn: F) -> F:
        existing = LOSSES.get(name)
        if existing is not None and not _same(existing, fn):
            raise ValueError(
                f"loss name {name!r} is already registered to "
                f"{existing.__module__}.{existing.__qualname__}"
            )
        LOSSES[name] = fn
        return fn

    return deco
