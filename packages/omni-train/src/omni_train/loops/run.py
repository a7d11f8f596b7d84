"""The run folder both loops write, and the cadence of its outputs.

    <run>/recipe.yaml        the fully resolved recipe (what `omni-train resume` reads)
    <run>/metrics.jsonl      one JSON object per step (+ TensorBoard / wandb when asked)
    <run>/samples/           sample grids (`step_XXXX.png`) and validation grids
    <run>/checkpoint/        `omni_train.checkpoint` folders, the learner's whole state
    <run>/reward_curve.png   the reward (and validation) per step, redrawn at the end

Step numbers are the same everywhere: step N is the N-th training step (1-based), its row has
``"step": N``, its grid is ``samples/step_N.png``, the validation after it
``samples/val_step_N.png`` and the checkpoint after it ``checkpoint/step_N`` (N completed
steps, the one a resume starts from). Step 0 is the model before training: its validation row
(``"step": 0``) is the baseline. The loops count the step index k = N - 1 internally (seeds,
data order).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ..checkpoint import load_checkpoint, remove_stale_saves, save_checkpoint
from ..logger import MetricsLogger, console_line, open_logger, read_metrics
from ..plots import plot_reward_curve
from ..recipe import Recipe, dump_recipe

__all__ = [
    "RUN_OUTPUTS",
    "RunFolder",
    "clear_run_dir",
    "repair_metrics",
    "sample_due",
    "save_due",
    "val_due",
]

#: files and folders a run writes; a fresh run in an existing folder removes these first
RUN_OUTPUTS = (
    "metrics.jsonl",
    "reward_curve.png",
    "recipe.yaml",
    "samples",
    "checkpoint",
    "tensorboard",
    "nonfinite",
)


def sample_due(recipe: Recipe, index: int) -> bool:
    """Does step N = index + 1 write a sample grid (the first, every `trainer.sample_every`,
    the last)?"""
    t, n = recipe.trainer, index + 1
    return bool(t.sample_every) and (n == 1 or n % t.sample_every == 0 or n == t.steps)


def val_due(recipe: Recipe, index: int) -> bool:
    """Does step N = index + 1 end with validation (every `trainer.val_every`, the last)?"""
    t, n = recipe.trainer, index + 1
    return bool(t.val_every) and (n % t.val_every == 0 or n == t.steps)


def save_due(recipe: Recipe, index: int) -> bool:
    """Does step N = index + 1 end with a checkpoint (every `trainer.save_every`, the last)?"""
    t, n = recipe.trainer, index + 1
    return (bool(t.save_every) and n % t.save_every == 0) or n == t.steps


def clear_run_dir(run_dir: Path) -> None:
    """Remove a previous run's outputs (only the names in `RUN_OUTPUTS`)."""
    for name in RUN_OUTPUTS:
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def repair_metrics(logger: MetricsLogger, step: int, state: dict[str, Any]) -> None:
    """Make metrics.jsonl end at checkpoint `step`: rows after it go (the resumed run writes
    them again), a line a kill cut short goes, and the step's own row, if a kill came between
    the save and its append, comes back from the checkpoint."""
    logger.truncate_after(step)
    row = state.get("row")
    if isinstance(row, dict) and step not in logger.steps():
        logger.log(row)


class RunFolder:
    """A run's folder, logger, progress bar and checkpoints."""

    def __init__(self, recipe: Recipe, run_dir: str | Path | None, *, fresh: bool) -> None:
        self.recipe = recipe
        self.path = Path(run_dir) if run_dir is not None else recipe.output_dir()
        if fresh:
            clear_run_dir(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        remove_stale_saves(self.path / "checkpoint")  # what a killed save left behind
        (self.path / "recipe.yaml").write_text(dump_recipe(recipe))
        self.logger: MetricsLogger = open_logger(recipe, self.path)
        self.bar: Any = None

    # ------------------------------------------------------------------ checkpoints
    def save(
        self,
        step: int,
        learner: Any,
        version: int,
        *,
        diffusers_lora: bool,
        row: dict | None,
        rollout_versions: dict[int, dict[str, Any]] | None = None,
    ) -> Path:
        """Checkpoint `step_{step}` (completed steps) with the learner's whole state, the LoRA
        in peft's layout and, for diffusion models, diffusers' `pytorch_lora_weights`. The
        step's metrics row goes in too, so a kill between the save and the row's append loses
        nothing: `restore` writes it back. `rollout_versions`: older weight versions that
        rollouts in flight were launched on (async mode, `schedule.RolloutHistory`)."""
        trainable, optimizer = learner.state()
        lora = learner.lora_export()
        files: dict[str, bytes] = {}
        if lora is not None and diffusers_lora:
            from safetensors.torch import save as st_save

            tensors, cfg = lora
            # diffusers reads the LoRA config (rank, alpha, targets) from this metadata key
            meta = {f"transformer.{k}": v for k, v in cfg.items()}
            files["pytorch_lora_weights.safetensors"] = st_save(
                {
                    "transformer." + k.removeprefix("base_model.model."): v
                    for k, v in tensors.items()
                },
                metadata={
                    "format": "pt",
                    "lora_adapter_metadata": json.dumps(meta, sort_keys=True),
                },
            )
        return save_checkpoint(
            self.path / "checkpoint",
            step,
            trainable,
            optimizer,
            state={
                "version": version,
                "experiment": self.recipe.experiment,
                "backend": self.recipe.trainer.backend,
                "row": json.loads(json.dumps(row, default=float)) if row is not None else None,
            },
            lora_tensors=None if lora is None else lora[0],
            lora_config=None if lora is None else lora[1],
            lora_files=files,
            keep=self.recipe.trainer.keep_checkpoints,
            rollout_versions=rollout_versions,
        )

    def restore(
        self, checkpoint: str | Path, learner: Any
    ) -> tuple[int, int, dict[int, dict[str, Any]]]:
        """Load a checkpoint into the learner and the RNGs; returns (step, weights version,
        the older rollout versions it holds) and drops metrics rows after that step (the
        resumed run writes them again)."""
        ck = load_checkpoint(checkpoint)
        learner.load_state(ck.trainable, ck.optimizer)
        ck.restore_rng()
        repair_metrics(self.logger, ck.step, ck.state)
        return ck.step, int(ck.state.get("version", ck.step)), ck.rollout_versions

    # ------------------------------------------------------------------ progress and logs
    def start(self, first_step: int) -> None:
        from tqdm.auto import tqdm

        t = self.recipe.trainer
        self.bar = tqdm(
            total=t.steps,
            initial=first_step,
            desc=self.recipe.experiment,
            disable=not t.progress,
            dynamic_ncols=True,
        )

    def log(self, row: dict[str, Any]) -> None:
        """Append step N's row; advance the bar; a console line every `log_every` steps."""
        t = self.recipe.trainer
        self.logger.log(row)
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{row['reward/mean']:.4f}")
        n = int(row["step"])
        if n % t.log_every == 0 or n == t.steps:
            self.say(console_line(row, t.steps))

    def log_baseline(self, metrics: dict[str, float]) -> None:
        """The step-0 row: validation of the model before any update."""
        self.logger.log({"step": 0, **metrics})
        val = metrics.get("val/reward_mean")
        if val is not None:
            self.say(f"step    0/{self.recipe.trainer.steps}  val {val:.4f}  (before training)")

    def say(self, message: str) -> None:
        """A console line that does not break the progress bar."""
        if self.recipe.trainer.progress and self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def finish(self, val_label: str = "val reward") -> None:
        if self.bar is not None:
            self.bar.close()
        rows = read_metrics(self.logger.path)
        if rows:
            plot_reward_curve(
                rows,
                self.path / "reward_curve.png",
                title=self.recipe.experiment,
                val_label=val_label,
            )
        self.logger.close()
