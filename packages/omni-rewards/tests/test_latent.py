from __future__ import annotations

import json

import numpy as np
import pytest

from omni_rewards import Reward, RewardInputError, RewardOutput, load_reward
from omni_rewards.cli import main
from omni_rewards.latent import (
    distill_latent,
    hash_prompt_features,
    pairwise_accuracy,
    save_scorer,
    spearman,
    synthetic_pairs,
)

torch = pytest.importorskip("torch")


def test_rank_metrics():
    a = np.array([1.0, 2.0, 3.0, 4.0])
    assert spearman(a, a * 10) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    assert pairwise_accuracy(a, a**2) == 1.0
    assert pairwise_accuracy(a, a[::-1]) == 0.0
    f = hash_prompt_features(["a red car", "a red car", "blue sky"], 32)
    np.testing.assert_allclose(f[0], f[1])
    assert np.linalg.norm(f[2]) == pytest.approx(1.0)


def test_distill_brightness_ranks_heldout_pairs(tmp_path):
    data = synthetic_pairs(200, seed=0)
    teacher = load_reward("brightness")
    model, cfg, report = distill_latent(
        teacher,
        data["latents"],
        data["images"],
        steps=150,
        seed=0,
        hidden=32,
        teacher_name="brightness",
    )
    assert report["heldout_pairs"] == 40
    assert report["spearman"] > 0.8, report
    assert report["pairwise_accuracy"] > 0.75, report
    path = save_scorer(model, cfg, tmp_path / "lrm", report)
    lrm = load_reward("latent", path=str(path), batch_size=16)
    out = lrm(latents=data["latents"][:50])
    teacher_scores = teacher(images=data["images"][:50]).scores
    assert spearman(out.scores, teacher_scores) > 0.8
    # scores come back in teacher units (brightness in [0, 1]), not normalised units
    assert abs(out.scores.mean() - teacher_scores.mean()) < 0.1
    with pytest.raises(RewardInputError, match=r"latents: expected \(B, 4, H, W\)"):
        lrm(latents=np.zeros((2, 3, 8, 8), np.float32))
    with pytest.raises(RewardInputError, match="latent needs `latents`"):
        lrm(images=data["images"][:2])
    # video latents (B, C, F, H, W): frames are pooled
    vid = np.stack([data["latents"][:3]] * 2, axis=2)
    assert lrm(latents=vid).scores.shape == (3,)


def test_distill_in_minibatches():
    """With batch_size each step fits a random minibatch: a step's cost stops growing with the
    pairs, and the scorer still ranks held-out pairs."""
    data = synthetic_pairs(400, seed=2)
    teacher = load_reward("brightness")
    kw = {"steps": 150, "seed": 0, "hidden": 32}
    _, _, full = distill_latent(teacher, data["latents"], data["images"], **kw)
    _, _, mini = distill_latent(teacher, data["latents"], data["images"], batch_size=32, **kw)
    assert mini["spearman"] > 0.8, mini
    assert mini["final_loss"] != full["final_loss"]  # a different fit, not the full batch
    with pytest.raises(ValueError, match="batch_size"):
        distill_latent(teacher, data["latents"], data["images"], batch_size=1, **kw)


class _BrightOrDark(Reward):
    """brightness if the prompt says "bright", else 1 - brightness: needs the prompt."""

    name = "bright_or_dark"

    def score_batch(self, inp):
        b = load_reward("brightness")(images=inp.images).scores
        return RewardOutput(np.where(["bright" in p for p in inp.prompts], b, 1 - b))


def test_distill_prompt_conditioned_teacher():
    data = synthetic_pairs(200, seed=1)
    prompts = ["a bright photo" if i % 2 else "a dark photo" for i in range(200)]
    _, cfg, report = distill_latent(
        _BrightOrDark(),
        data["latents"],
        data["images"],
        prompts=prompts,
        steps=200,
        seed=0,
        hidden=32,
    )
    assert cfg.prompt_features == "hash"
    assert report["spearman"] > 0.7, report


def test_distill_cli(tmp_path, capsys):
    out_dir = tmp_path / "scorer"
    rc = main(
        [
            "distill-latent",
            "--teacher",
            "brightness",
            "--synthetic",
            "120",
            "--steps",
            "80",
            "--batch-size",
            "48",
            "--out",
            str(out_dir),
        ]
    )
    assert rc == 0
    report = json.loads((out_dir / "report.json").read_text())
    out = capsys.readouterr()
    assert "spearman=" in out.out
    assert "latent scorer" in out.err and "80/80" in out.err  # the progress bar, to its end
    assert report["spearman"] > 0.5 and report["pairs"] == 120
    assert (out_dir / "model.safetensors").is_file()
    args = ["distill-latent", "--synthetic", "20", "--steps", "3", "--out", str(tmp_path / "b")]
    assert main([*args, "--no-progress"]) == 0
    assert "latent scorer" not in capsys.readouterr().err
