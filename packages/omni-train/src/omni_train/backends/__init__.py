"""Scale-out backends: `ray` (Ray actors + FSDP2, sync or async) and `verl` (the omni path).

`run_backend(recipe, run_dir)` is what `omni_train.trainer.train` calls when
`trainer.backend != "local"`. `BACKENDS` is the registry (a dict: name -> entry point).
Ray and verl are optional extras and imported only when their backend runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import TrainError
from ..recipe import Recipe

__all__ = ["BACKENDS", "register_backend", "run_backend"]

Entry = Callable[[Recipe, "str | Path | None"], list[dict[str, Any]]]


def _ray(recipe: Recipe, run_dir: str | Path | None) -> list[dict[str, Any]]:
    try:
        import ray  # noqa: F401
    except ModuleNotFoundError:
        raise TrainError(
            "trainer.backend: 'ray' needs Ray: pip install 'omni-train[ray]'"
        ) from None
    from .ray_backend import train_ray

    return train_ray(recipe, run_dir)


def _verl(recipe: Recipe, run_dir: str | Path | None) -> list[dict[str, Any]]:
    from .verl_backend import run_verl

    return run_verl(recipe, run_dir)


BACKENDS: dict[str, Entry] = {"ray": _ray, "verl": _verl}


def register_backend(name: str, entry: Entry) -> None:
    """Add a backend (`trainer.backend: name` must also be allowed by the recipe schema)."""
    BACKENDS[name] = entry


def run_backend(recipe: Recipe, run_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Run `recipe` on `recipe.trainer.backend`; returns the per-step metric rows."""
    name = recipe.trainer.backend
    if name not in BACKENDS:
        raise TrainError(f"trainer.backend: unknown backend {name!r}; known: {sorted(BACKENDS)}")
    return BACKENDS[name](recipe, run_dir)
