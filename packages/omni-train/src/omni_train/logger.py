"""Metrics: one JSON object per step in metrics.jsonl, optional TensorBoard, a console line."""

from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path
from typing import Any

import numpy as np

from .errors import TrainError


def _clean(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl file. A last line a kill cut short is left out; a bad line
    elsewhere is a ValueError naming it."""
    p = Path(path)
    if not p.is_file():
        return []
    lines = [ln for ln in p.read_text(errors="replace").splitlines() if ln.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break  # the half-written row of a killed run: resume writes it again
            raise ValueError(f"{p}, line {i + 1}: not a JSON object") from None
        if isinstance(row, dict):
            rows.append(row)
    return rows


class MetricsLogger:
    """Appends step rows to `<run>/metrics.jsonl` and mirrors scalars to TensorBoard."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = False,
        wandb: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.tb = None
        self.wandb = None if wandb is None else _wandb_run(self.run_dir, **wandb)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise TrainError(
                    "trainer.report_to: tensorboard needs TensorBoard: "
                    "pip install 'omni-train[tensorboard]'"
                ) from None
            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drop rows with `step` > the given step (a resumed run rewrites them), and a last
        line a kill cut short."""
        keep = [json.dumps(r) for r in read_metrics(self.path) if r.get("step", -1) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        tmp.replace(self.path)

    def steps(self) -> set[int]:
        """The step numbers that have a row."""
        return {int(r["step"]) for r in read_metrics(self.path) if "step" in r}

    def log(self, row: dict[str, Any]) -> None:
        row = {k: _clean(v) for k, v in row.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:  # durable before the checkpoint that follows it
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.tb is not None:
            step = int(row["step"])
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(
                {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))},
                step=int(row["step"]),
            )

    def log_image(self, tag: str, path: str | Path, step: int) -> None:
        """The PNG at `path` (a sample grid the run already wrote) to TensorBoard and wandb;
        nothing is read when neither is on (metrics.jsonl holds no images)."""
        if self.tb is None and self.wandb is None:
            return
        from PIL import Image

        with Image.open(path) as png:
            image = np.asarray(png.convert("RGB"))
        if self.tb is not None:
            self.tb.add_image(tag, image, step, dataformats="HWC")
            self.tb.flush()
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Image(image)}, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def open_logger(recipe: Any, run_dir: str | Path) -> MetricsLogger:
    """The run's logger as the recipe asks: metrics.jsonl, plus TensorBoard and wandb."""
    t = recipe.trainer
    wandb = None
    if "wandb" in t.report_to:
        wandb = {
            "project": t.wandb_project,
            "name": recipe.experiment,
            "config": recipe.model_dump(mode="json"),
        }
    return MetricsLogger(run_dir, tensorboard="tensorboard" in t.report_to, wandb=wandb)


def _wandb_run(run_dir: Path, project: str, name: str, config: dict[str, Any]) -> Any:
    """A wandb run under `<run>/wandb`; its id is kept in `<run>/wandb_id.txt`, so a resumed
    run continues the same wandb run. `WANDB_MODE=offline` works without a network."""
    try:
        import wandb
    except ImportError:
        raise TrainError(
            "trainer.report_to: wandb needs wandb: pip install 'omni-train[wandb]'"
        ) from None
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file = run_dir / "wandb_id.txt"
    if id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = secrets.token_hex(4)  # wandb ids: lowercase letters and digits
        id_file.write_text(run_id + "\n")
    return wandb.init(
        project=project, name=name, id=run_id, resume="allow", dir=str(run_dir), config=config
    )


def console_line(row: dict[str, Any], total_steps: int) -> str:
    """`step  3/20  reward 0.412 ± 0.103  val 0.430  kl_ref 1.2e-05  |g| 0.031  12 img/s  2.3s`:
    what moves from step to step (a one-epoch PPO loss is 0 by construction, so it is not
    shown; it stays in metrics.jsonl)."""
    parts = [f"step {row['step']:>4}/{total_steps}"]
    parts.append(f"reward {row['reward/mean']:.4f} ± {row['reward/std']:.4f}")
    if "val/reward_mean" in row:
        parts.append(f"val {row['val/reward_mean']:.4f}")
    if "actor/kl_ref" in row:
        parts.append(f"kl_ref {row['actor/kl_ref']:.1e}")
    elif "actor/approx_kl" in row:
        parts.append(f"kl_old {row['actor/approx_kl']:.1e}")
    if "actor/grad_norm" in row:
        parts.append(f"|g| {row['actor/grad_norm']:.3g}")
    if "reward/frac_zero_std" in row:
        parts.append(f"flat {row['reward/frac_zero_std']:.2f}")
    for key, unit in (("perf/images_per_s", "img/s"), ("perf/samples_per_s", "samples/s")):
        if key in row:
            parts.append(f"{row[key]:.1f} {unit}")
    if "timing/step_s" in row:
        parts.append(f"{row['timing/step_s']:.1f}s")
    return "  ".join(parts)
