"""Entry points: run a recipe, or resume a run folder.

A run is never lost by running again: `train(recipe)` into a folder that already holds a run
of the same recipe resumes it from its latest checkpoint (and says so); a folder holding a run
of another recipe is refused with the first difference named, unless `trainer.overwrite` is
set. Keys that do not change what is computed (the number of steps, logging, checkpoint and
validation cadence, trackers) may differ: raising `trainer.steps` continues a finished run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .algorithms import algorithm
from .checkpoint import CheckpointError, checkpoint_of_step, newest_good_checkpoint
from .errors import TrainError
from .logger import read_metrics
from .recipe import Recipe, load_recipe

__all__ = ["resume", "train"]

#: keys a resumed run may change: they do not change what is computed
RESUMABLE_CHANGES = {
    "trainer.steps",
    "trainer.output_dir",
    "trainer.overwrite",
    "trainer.progress",
    "trainer.log_every",
    "trainer.sample_every",
    "trainer.save_every",
    "trainer.keep_checkpoints",
    "trainer.val_every",
    "trainer.report_to",
    "trainer.wandb_project",
    "trainer.threads",
    "trainer.max_restarts",
}


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and prefix.count(".") < 1:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def recipe_difference(saved: dict[str, Any], recipe: Recipe) -> str | None:
    """The first key (not in `RESUMABLE_CHANGES`) whose value differs, as ``key: a -> b``."""
    a, b = _flat(saved), _flat(recipe.model_dump(mode="json"))
    for key in sorted(set(a) | set(b)):
        if key in RESUMABLE_CHANGES:
            continue
        if a.get(key) != b.get(key):
            return f"{key}: {a.get(key)!r} in the saved run, {b.get(key)!r} now"
    return None


def existing_run(recipe: Recipe, run_dir: Path) -> Path | None:
    """What to do with a folder that may hold a run: None (start fresh) or the checkpoint to
    resume from. Raises TrainError for a run of another recipe (module docstring)."""
    from .loops import clear_run_dir

    saved = run_dir / "recipe.yaml"
    if not saved.is_file():
        return None
    if recipe.trainer.overwrite:
        print(f"trainer.overwrite: starting over in {run_dir}", flush=True)
        clear_run_dir(run_dir)
        return None
    diff = recipe_difference(yaml.safe_load(saved.read_text()) or {}, recipe)
    if diff is not None:
        raise TrainError(
            f"trainer.output_dir: {run_dir} holds a run of another recipe ({diff}); pick another "
            "folder (trainer.output_dir=...) or start over there with trainer.overwrite=true"
        )
    ck = good_checkpoint(run_dir)
    if ck is None:
        print(
            f"{run_dir} holds this recipe's run but no checkpoint yet: starting it over", flush=True
        )
        clear_run_dir(run_dir)
        return None
    return ck


def good_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of a run that verifies (`omni_train.checkpoint.verify_checkpoint`),
    saying which damaged newer ones it passes over; TrainError when they all are damaged."""
    ck, skipped = newest_good_checkpoint(run_dir / "checkpoint")
    for why in skipped:
        print(f"resume: {why}; falling back to an older checkpoint", flush=True)
    if ck is None and skipped:
        raise TrainError(f"resume: no checkpoint of {run_dir} verifies ({skipped[-1]})")
    return ck


def _run(
    recipe: Recipe, run_dir: str | Path | None, resume_from: Path | None
) -> list[dict[str, Any]]:
    from .backends import make_ports
    from .checkpoint import load_checkpoint_state, remove_stale_saves
    from .loops import DiffusionLoop, OmniLoop

    if recipe.trainer.backend == "verl":  # verl runs the whole omni loop itself
        from .backends.verl_backend import run_verl

        if resume_from is not None:
            raise TrainError("resume: a verl run resumes with verl's own trainer.resume_mode")
        return run_verl(recipe, run_dir)
    folder = Path(run_dir) if run_dir is not None else recipe.output_dir()
    remove_stale_saves(folder / "checkpoint")  # what a killed save left behind
    if resume_from is not None:
        state = load_checkpoint_state(resume_from)
        done = int(state["step"])
        if done >= recipe.trainer.steps:
            from .logger import MetricsLogger
            from .loops.run import repair_metrics

            repair_metrics(MetricsLogger(folder), done, state)
            print(
                f"{folder} is complete ({done} of trainer.steps={recipe.trainer.steps}); raise "
                "trainer.steps to continue it, or trainer.overwrite=true to start over",
                flush=True,
            )
            return [r for r in read_metrics(folder / "metrics.jsonl") if "reward/mean" in r]
        print(f"resuming {folder} from step {done}", flush=True)
    ports = make_ports(recipe)
    try:
        loop_cls = OmniLoop if algorithm(recipe.algorithm.name).model == "omni" else DiffusionLoop
        return loop_cls(recipe, ports, folder).train(resume_from=resume_from)
    finally:
        ports.close()


def train(recipe: Recipe, run_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Run a recipe on `trainer.backend`; returns the per-step metric rows of this call. A
    folder holding a run of the same recipe is resumed (module docstring)."""
    folder = Path(run_dir) if run_dir is not None else recipe.output_dir()
    resume_from = None if recipe.trainer.backend == "verl" else existing_run(recipe, folder)
    return _run(recipe, run_dir, resume_from)


def resume(
    run: str | Path, overrides: list[str] | None = None, checkpoint: int | None = None
) -> list[dict[str, Any]]:
    """Continue `run` from its latest checkpoint (or `checkpoint` = that step's) with its
    saved recipe (plus `overrides`), on the backend the run used."""
    run = Path(run)
    recipe_path = run / "recipe.yaml"
    if not recipe_path.is_file():
        raise TrainError(f"resume: {run} is not a run folder (no recipe.yaml)")
    if checkpoint is not None:
        try:
            ck = checkpoint_of_step(run, checkpoint)
        except CheckpointError as e:
            raise TrainError(f"resume --checkpoint: {e}") from None
    else:
        found = good_checkpoint(run)
        if found is None:
            raise TrainError(f"resume: {run} has no complete checkpoint under {run / 'checkpoint'}")
        ck = found
    recipe = load_recipe(recipe_path, [*list(overrides or []), f"trainer.output_dir={run}"])
    return _run(recipe, run, ck)
