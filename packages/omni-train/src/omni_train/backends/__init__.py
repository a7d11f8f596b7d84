"""Backends: where the ports of a run live (`omni_train.ports`).

`BACKENDS` maps `trainer.backend` to a function that builds a run's `Ports`: ``local`` (one
process) and ``ray`` (Ray actors, FSDP2). ``verl`` is different: it hands the whole omni run to
verl's PPO trainer (`omni_train.backends.verl_backend.run_verl`). Ray and verl are optional
extras, imported only when their backend runs.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import TrainError
from ..ports import Ports
from ..recipe import Recipe

__all__ = ["BACKENDS", "make_ports", "register_backend"]


def _local(recipe: Recipe) -> Ports:
    from .local import make_local_ports

    return make_local_ports(recipe)


def _ray(recipe: Recipe) -> Ports:
    from .ray import make_ray_ports

    return make_ray_ports(recipe)


BACKENDS: dict[str, Callable[[Recipe], Ports]] = {"local": _local, "ray": _ray}


def register_backend(name: str, make: Callable[[Recipe], Ports]) -> None:
    """Add a backend (`trainer.backend: name` must also be allowed by the recipe schema)."""
    BACKENDS[name] = make


def make_ports(recipe: Recipe) -> Ports:
    """The ports of `recipe.trainer.backend` for one run."""
    name = recipe.trainer.backend
    if name not in BACKENDS:
        raise TrainError(f"trainer.backend: unknown backend {name!r}; known: {sorted(BACKENDS)}")
    return BACKENDS[name](recipe)
