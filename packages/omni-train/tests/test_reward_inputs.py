"""`reward.inputs` (latents without a decode, audio), the latent-scorer fit, `lora.full_regex`."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omni_train_testutils import local_loop

from omni_train import train
from omni_train.errors import TrainError
from omni_train.latent_scorer import model_fingerprint, rollout_in_chunks
from omni_train.recipe import RecipeError, recipe_from_dict


def test_latent_reward_trains_without_decoding(train_dict, tmp_path: Path) -> None:
    scorer = tmp_path / "scorer"
    d = train_dict(
        reward={
            "name": "latent",
            "options": {"path": str(scorer)},
            "inputs": ["latents"],
            "distill": {"teacher": "brightness", "samples": 24, "steps": 20},
        },
        trainer={"sample_every": 3, "steps": 5},
    )
    loop = local_loop(recipe_from_dict(d), tmp_path / "run")
    report = json.loads((scorer / "report.json").read_text())
    assert report["pairs"] == 24 and report["teacher"] == "brightness"
    reqs = loop.requests_for(1)
    assert {q.params.output for q in reqs} == {"latent"}  # index 1 = step 2: not a sample step
    trajs = loop.ports.rollout.generate_many(reqs)
    assert all(tr.media is None and tr.final_latent is not None for tr in trajs)
    rewards, _, media = loop.score(trajs, 1)
    assert media is None and np.isfinite(rewards).all()  # no decode at all
    trajs0 = loop.ports.rollout.generate_many(loop.requests_for(0))
    _, _, media0 = loop.score(trajs0, 0)  # step 1 is a sample step: decoded for the grid only
    assert media0 is not None and media0.shape == (8, 32, 32, 3)
    # the distill rollouts run in chunks for their progress bar: whole waves (4 rows here)
    # run as one call would run them, so the chunked rollout is the same to the bit
    reqs = loop.requests_for(0)
    assert len(reqs) == 8 and loop.recipe.rollout.max_num_seqs == 16
    loop.ports.rollout.max_num_seqs = 4
    whole = loop.ports.rollout.generate_many(reqs)
    chunked = rollout_in_chunks(loop.ports.rollout, reqs, 4, progress=True, desc="distill")
    assert [t.request_id for t in chunked] == [q.request_id for q in reqs]
    assert all(torch.equal(a.final_latent, b.final_latent) for a, b in zip(whole, chunked))
    loop.ports.close()
    # the scorer is not refitted when it exists and was fitted for these settings, whatever
    # the trainer's seed (the scorer is the run's reward model: reward.distill.seed)
    assert report["fitted_for"]["reward.distill"]["seed"] == 0
    # the model by its files, not its folder: a copy elsewhere is the same model, a change
    # to a weight file is another one
    assert report["fitted_for"]["model_sha256"] == model_fingerprint(d["model"]["path"])
    copy_ = tmp_path / "model_copy"
    shutil.copytree(d["model"]["path"], copy_)
    (copy_ / "README.md").write_text("a model card is not the model\n")
    assert model_fingerprint(copy_) == model_fingerprint(d["model"]["path"])
    weights = sorted(copy_.rglob("*.safetensors"))[0]
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1
    weights.write_bytes(bytes(blob))
    assert model_fingerprint(copy_) != model_fingerprint(d["model"]["path"])
    mtime = (scorer / "model.safetensors").stat().st_mtime_ns
    d["trainer"]["seed"] = 3
    local_loop(recipe_from_dict(d), tmp_path / "run2").ports.close()
    assert (scorer / "model.safetensors").stat().st_mtime_ns == mtime
    # other settings: a clear error naming what differs; the folder is left as it was
    for key, value, said in [
        ("samples", 32, "reward.distill.samples: this run 32, the scorer 24"),
        ("seed", 1, "reward.distill.seed: this run 1, the scorer 0"),
    ]:
        other = copy.deepcopy(d)
        other["reward"]["distill"][key] = value
        with pytest.raises(TrainError, match=r"reward\.options\.path: .*" + re.escape(said)):
            local_loop(recipe_from_dict(other), tmp_path / "run3")
    other = copy.deepcopy(d)
    other["data"]["prompts"] = ["a blue square"]
    with pytest.raises(TrainError, match=r"fitted for other settings \(prompts_sha256: "):
        local_loop(recipe_from_dict(other), tmp_path / "run3")
    assert (scorer / "model.safetensors").stat().st_mtime_ns == mtime
    # an unreadable report is an error naming it, not a traceback
    good = (scorer / "report.json").read_text()
    (scorer / "report.json").write_text("{not json")
    with pytest.raises(TrainError, match=r"reward\.options\.path: .*report\.json cannot be read"):
        local_loop(recipe_from_dict(d), tmp_path / "run3")
    (scorer / "report.json").write_text(good)
    # a scorer folder that records no fitting settings (made elsewhere, or by an older
    # version) is reused as it is
    del report["fitted_for"]
    (scorer / "report.json").write_text(json.dumps(report))
    other["reward"]["distill"]["samples"] = 32
    local_loop(recipe_from_dict(other), tmp_path / "run4").ports.close()
    assert (scorer / "model.safetensors").stat().st_mtime_ns == mtime


def test_reward_input_errors_name_the_field(train_dict, tmp_path: Path) -> None:
    d = train_dict(reward={"inputs": ["audio"]})
    with pytest.raises(TrainError, match=r"reward\.inputs: audio needs a video\+audio model"):
        train(recipe_from_dict(d), tmp_path / "a")
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
        train(recipe_from_dict(d), tmp_path / "b")


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
    from omni_train.models import load_policy

    adapter = load_policy(recipe_from_dict(d))
    trained = {n for n, p in adapter.model.named_parameters() if p.requires_grad}
    assert trained and all(re.fullmatch(regex, n) for n in trained)
    assert "language_model.layers.0.self_attn.q_proj.weight" not in trained
    assert "vae2llm.weight" in trained
    d["lora"]["full_regex"] = "nothing_matches"
    with pytest.raises(TrainError, match=r"lora\.full_regex: 'nothing_matches' matches no"):
        load_policy(recipe_from_dict(d))
    d["lora"]["full_regex"] = "(unclosed"
    with pytest.raises(RecipeError, match=r"lora\.full_regex"):
        recipe_from_dict(d)
