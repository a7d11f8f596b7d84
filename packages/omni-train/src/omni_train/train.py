"""Entry points: run a recipe from step 0, or resume a run folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .algorithms import algorithm
from .checkpoint import latest_checkpoint
from .errors import TrainError
from .recipe import Recipe, load_recipe

__all__ = ["resume", "train"]


def _run(
    recipe: Recipe, run_dir: str | Path | None, resume_from: Path | None
) -> list[dict[str, Any]]:
    from .backends import make_ports
    from .loops import DiffusionLoop, OmniLoop

    if recipe.trainer.backend == "verl":  # verl runs the whole omni loop itself
        from .backends.verl_backend import run_verl

        if resume_from is not None:
            raise TrainError("resume: a verl run resumes with verl's own trainer.resume_mode")
        return run_verl(recipe, run_dir)
    ports = make_ports(recipe)
    try:
        loop_cls = OmniLoop if algorithm(recipe.algorithm.name).model == "omni" else DiffusionLoop
        return loop_cls(recipe, ports, run_dir).train(resume_from=resume_from)
    finally:
        ports.close()


def train(recipe: Recipe, run_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Run a recipe from step 0 on `trainer.backend`; returns the per-step metric rows."""
    return _run(recipe, run_dir, None)


def resume(run: str | Path, overrides: list[str] | None = None) -> list[dict[str, Any]]:
    """Continue `run` from its latest checkpoint with its saved recipe (plus `overrides`),
    on the backend the run used."""
    run = Path(run)
    recipe_path = run / "recipe.yaml"
    if not recipe_path.is_file():
        raise TrainError(f"resume: {run} is not a run folder (no recipe.yaml)")
    ck = latest_checkpoint(run / "checkpoint")
    if ck is None:
        raise TrainError(f"resume: {run} has no complete checkpoint under {run / 'checkpoint'}")
    recipe = load_recipe(recipe_path, [*list(overrides or []), f"trainer.output_dir={run}"])
    return _run(recipe, run, ck)
