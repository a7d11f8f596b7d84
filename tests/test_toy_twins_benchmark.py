"""benchmarks/toy_twins.py runs a twin, scores it and the base model with `omni-train eval`
on each prompt file, and prints the gain against its standard error and the accuracy per task
type (here one twin, one step, a tiny batch; the real runs take minutes each)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TASK_ORDER = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


@pytest.mark.slow
def test_one_twin_trains_evaluates_and_prints_its_gain(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "toy_twins.py"),
        *("--recipes", "recipes/toy/diffusion_dpo.yaml", "--seed", "3", "--n", "2"),
        *("--out", str(tmp_path)),
        *("--prompts", "recipes/data/shapes/colors_heldout.txt"),
        "recipes/data/shapes/handwritten.txt",
        *("--set", "data.prompts_per_step=2", "rollout.n=2", "trainer.steps=1"),
    ]
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    run = tmp_path / "diffusion_dpo_seed3"
    trainer = yaml.safe_load((run / "recipe.yaml").read_text())["trainer"]
    assert (trainer["steps"], trainer["seed"], trainer["val_every"]) == (1, 3, 0)
    tables = out.stdout.split("\ncolors_heldout: ")[1].split("\nhandwritten: ")
    for stem, table, count in (("colors_heldout", tables[0], 8), ("handwritten", tables[1], 88)):
        base = json.loads((tmp_path / f"base_{stem}" / "eval.json").read_text())
        after = json.loads((tmp_path / f"diffusion_dpo_seed3_{stem}" / "eval.json").read_text())
        assert base["kind"] == "model" and after["kind"] == "run" and after["count"] == count
        gain, se = after["mean"] - base["mean"], math.hypot(base["stderr"], after["stderr"])
        row = re.search(r"^\| diffusion_dpo \| diffusion_dpo \| \d+ \| (.*)$", table, re.M)
        assert row, out.stdout
        cells = [c.strip() for c in row.group(1).split("|")]
        assert cells[0] == f"{after['mean']:.3f} +- {after['stderr']:.3f}"
        assert cells[1] == f"{gain:+.3f}"
        assert cells[3] == ("yes" if gain > 2 * se else "no")
        # GenEval's columns: the file's task types, in GenEval's order
        tasks = list(after["per_task"])
        assert cells[5:-1] == [
            f"{after['per_task'][t]['mean']:.3f}" for t in TASK_ORDER if t in tasks
        ]
    assert len(cells[5:-1]) == 6  # the hand-written file has every task type
