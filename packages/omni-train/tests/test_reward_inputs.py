"""`reward.inputs` (latents without a decode, audio), the latent-scorer fit, `lora.full_regex`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from omni_train.errors import TrainError
from omni_train.recipe import RecipeError, recipe_from_dict
from omni_train.trainer import LocalTrainer


def test_latent_reward_trains_without_decoding(train_dict, tmp_path: Path) -> None:
    scorer = tmp_path / "scorer"
    d = train_dict(
        reward={
            "name": "latent",
            "options": {"path": str(scorer)},
            "inputs": ["latents"],
            "distill": {"teacher": "brightness", "samples": 24, "steps": 20},
        },
        trainer={"sample_every": 2, "steps": 4},
    )
    t = LocalTrainer(recipe_from_dict(d), tmp_path / "run")
    t.setup()
    report = json.loads((scorer / "report.json").read_text())
    assert report["pairs"] == 24 and report["teacher"] == "brightness"
    assert t.params.output == "latent"
    b = t.rollout(1)
    assert all(tr.media is None and tr.final_latent is not None for tr in b.trajectories)
    t.score(b, 1)  # step 1 is not a sample step: no decode at all
    assert b.images is None and np.isfinite(b.rewards).all()
    b0 = t.rollout(0)
    t.score(b0, 0)  # a sample step: decoded for the grid only
    assert b0.images is not None and b0.images.shape == (8, 32, 32, 3)
    # the scorer is not refitted when it exists
    mtime = (scorer / "model.safetensors").stat().st_mtime_ns
    t2 = LocalTrainer(recipe_from_dict(d), tmp_path / "run2")
    t2.setup()
    assert (scorer / "model.safetensors").stat().st_mtime_ns == mtime


def test_reward_input_errors_name_the_field(train_dict, tmp_path: Path) -> None:
    d = train_dict(reward={"inputs": ["audio"]})
    with pytest.raises(TrainError, match=r"reward\.inputs: audio needs a video\+audio model"):
        LocalTrainer(recipe_from_dict(d), tmp_path / "a").setup()
    d = train_dict(reward={"inputs": ["media", "media"]})
    with pytest.raises(RecipeError, match=r"reward\.inputs"):
        recipe_from_dict(d)
    d = train_dict(reward={"distill": {"teacher": "brightness"}})
    with pytest.raises(RecipeError, match=r"reward\.distill: only for `reward\.name: latent`"):
        recipe_from_dict(d)
    d = train_dict(
        reward={
            "name": "latent",
            "options": {"path": str(tmp_path / "s")},
            "inputs": ["latents"],
            "distill": {"teacher": "no_such_reward"},
        }
    )
    with pytest.raises(TrainError, match=r"reward\.distill\.teacher: unknown reward"):
        LocalTrainer(recipe_from_dict(d), tmp_path / "b").setup()


def test_full_regex_trains_only_matching_parameters(tmp_path: Path) -> None:
    from omni_adapters import tiny

    model = tmp_path / "bagel"
    tiny.build("bagel", model, seed=0)
    regex = r".*_moe_gen.*|vae2llm\..*"
    d = {
        "model": {"path": str(model), "tiny": "bagel"},
        "lora": {"enabled": False, "full_regex": regex},
        "data": {"prompts": ["a red square"], "prompts_per_step": 1},
        "rollout": {
            "n": 2,
            "height": 32,
            "width": 32,
            "num_steps": 2,
            "sde_window_size": 1,
            "sde_window_range": [0, 1],
        },
        "reward": {"name": "brightness"},
        "trainer": {"steps": 1, "progress": False},
    }
    t = LocalTrainer(recipe_from_dict(d), tmp_path / "run")
    t.setup()
    trained = {n for n, p in t.adapter.model.named_parameters() if p.requires_grad}
    assert trained and all(re.fullmatch(regex, n) for n in trained)
    assert "language_model.layers.0.self_attn.q_proj.weight" not in trained
    assert "vae2llm.weight" in trained
    d["lora"]["full_regex"] = "nothing_matches"
    with pytest.raises(TrainError, match=r"lora\.full_regex: 'nothing_matches' matches no"):
        LocalTrainer(recipe_from_dict(d), tmp_path / "r2").setup()
    d["lora"]["full_regex"] = "(unclosed"
    with pytest.raises(RecipeError, match=r"lora\.full_regex"):
        recipe_from_dict(d)
