"""The toy twins (recipes/toy/, one per text-to-image algorithm, on the shapes world's shipped toy
SD3 and the quickstart's task) run end to end as shipped, at a smaller batch: the recipe, the
shipped model, the algorithm's loop and validation on the held-out colour pairs, a checkpoint,
and `omni-train eval` of the run. Whether each one learns is measured by
benchmarks/toy_twins.py (minutes a run), not here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from omni_train.cli import main
from omni_train.recipe import load_recipe
from omni_train.recipes_cli import recipes_root

RECIPES = recipes_root()
TOY_TWINS = sorted((RECIPES / "toy").glob("*.yaml"))
# twin -> algorithm: one per text-to-image algorithm (MixGRPO's is the quickstart), and the
# latent-reward row's (FlowGRPO against a latent scorer fitted to the shapes reward)
TWIN_ALGORITHMS = {
    "flow_grpo": "flow_grpo", "flow_dppo": "flow_dppo", "grpo_guard": "grpo_guard",
    "dance_grpo": "dance_grpo", "diffusion_nft": "diffusion_nft",
    "diffusion_dpo": "diffusion_dpo", "latent_reward": "flow_grpo",
}  # fmt: skip


def test_every_text_to_image_algorithm_has_a_toy_twin() -> None:
    """Each twin runs its algorithm on the shipped toy model and the shapes world's colour
    pairs, validated on the held-out ones."""
    assert {p.stem: load_recipe(p).algorithm.name for p in TOY_TWINS} == TWIN_ALGORITHMS
    assert load_recipe(RECIPES / "quickstart.yaml").algorithm.name == "mix_grpo"
    # DiffusionNFT learns here only re-noising at the schedule's steps (docs/toy_world.md)
    nft = load_recipe(RECIPES / "toy" / "diffusion_nft.yaml").algorithm
    assert nft.timestep_sampling == "schedule"
    # online DPO learns here only with several pairs a prompt group (docs/toy_world.md)
    assert load_recipe(RECIPES / "toy" / "diffusion_dpo.yaml").algorithm.pairs_per_group == 8
    for path in TOY_TWINS:
        r = load_recipe(path)
        assert r.experiment == f"toy_{path.stem}", path.name
        assert r.model.path == "recipes/models/shapes_sd3" and r.model.tiny is None, path.name
        teacher = r.reward.distill.teacher if r.reward.distill else r.reward.name
        assert teacher == "shapes", path.name
        assert r.data.file == "recipes/data/shapes/colors_train.txt", path.name
        assert r.data.val_file == "recipes/data/shapes/colors_heldout.txt", path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", TOY_TWINS, ids=lambda p: p.stem)
def test_toy_twin_runs_and_evaluates(path: Path, tmp_path: Path, capsys) -> None:
    data = RECIPES / "data" / "shapes"
    run = tmp_path / "run"
    argv = [
        str(path),
        f"model.path={RECIPES / 'models' / 'shapes_sd3'}",
        f"data.file={data / 'colors_train.txt'}",
        f"data.val_file={data / 'colors_heldout.txt'}",
        "data.prompts_per_step=2",
        "rollout.n=4",
        "trainer.steps=2",
        "trainer.val_every=2",
        "trainer.val_num_steps=2",
        "trainer.val_samples_per_prompt=1",
        "trainer.save_every=2",
        "trainer.progress=false",
        f"trainer.output_dir={run}",
    ]
    if load_recipe(path).reward.distill is not None:  # fit a small scorer for this run
        argv += [f"reward.options.path={tmp_path / 'scorer'}", "reward.distill.samples=16"]
        argv += ["reward.distill.steps=5", "reward.distill.batch_size=8"]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # a step whose prompt groups all scored alike has no advantage, no pair and no loss
    losses = [r["loss"] for r in steps if "loss" in r]
    assert losses and all(np.isfinite(losses))
    assert [r["step"] for r in rows if "val/reward_mean" in r] == [0, 2]
    assert (run / "checkpoint" / "step_0002" / "state.json").is_file()
    capsys.readouterr()
    argv = ["eval", str(run), "--prompts", str(data / "colors_heldout.txt"), "--reward", "shapes"]
    argv += ["--n", "1", "--out", str(tmp_path / "ev"), "--no-progress"]
    assert main(argv) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev["kind"] == "run" and ev["count"] == 4
    assert ev["checkpoint"].endswith("step_0002")
