"""Runs are never lost: running a recipe again resumes it, another recipe is refused, a
finished run stays finished; resume from a chosen checkpoint; Ctrl-C says how to continue;
the learning-rate schedule; export of the trained weights."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from omni_train_testutils import without_timings

from omni_train import train
from omni_train.cli import main
from omni_train.errors import TrainError
from omni_train.logger import read_metrics
from omni_train.loops import DiffusionLoop
from omni_train.lr_schedule import learning_rate
from omni_train.recipe import recipe_from_dict


def test_running_again_resumes_and_keeps_the_run(train_dict, tmp_path: Path, capsys) -> None:
    d = train_dict(trainer={"steps": 2, "save_every": 1, "sample_every": 0})
    first = train(recipe_from_dict(d))
    run = Path(d["trainer"]["output_dir"])
    before = read_metrics(run / "metrics.jsonl")
    again = train(recipe_from_dict(d))  # the documented re-run: nothing lost, nothing redone
    assert "is complete" in capsys.readouterr().out
    assert without_timings(again) == without_timings(first)
    assert read_metrics(run / "metrics.jsonl") == before
    more = train(recipe_from_dict({**d, "trainer": {**d["trainer"], "steps": 3}}))
    assert "resuming" in capsys.readouterr().out and [r["step"] for r in more] == [3]
    straight = train_dict(
        trainer={
            "steps": 3,
            "save_every": 1,
            "sample_every": 0,
            "output_dir": str(tmp_path / "straight"),
        }
    )
    on_disk = read_metrics(run / "metrics.jsonl")
    assert without_timings(on_disk) == without_timings(train(recipe_from_dict(straight)))


def test_another_recipe_is_refused_and_overwrite_starts_over(train_dict, capsys) -> None:
    d = train_dict(trainer={"steps": 1, "sample_every": 0})
    train(recipe_from_dict(d))
    other = {**d, "rollout": {**d["rollout"], "n": 2}}
    with pytest.raises(
        TrainError,
        match=r"trainer.output_dir: .* another recipe \(rollout.n: 4 in the saved run, 2 now\).*trainer.overwrite=true",
    ):
        train(recipe_from_dict(other))
    rows = train(recipe_from_dict({**other, "trainer": {**other["trainer"], "overwrite": True}}))
    assert "starting over" in capsys.readouterr().out and rows[0]["rollout/rows"] == 4


def test_resume_from_a_chosen_checkpoint(train_dict, capsys) -> None:
    d = train_dict(trainer={"steps": 3, "save_every": 1, "keep_checkpoints": 3, "sample_every": 0})
    full = train(recipe_from_dict(d))
    run = d["trainer"]["output_dir"]
    assert main(["resume", run, "--checkpoint", "1"]) == 0
    assert "resuming" in capsys.readouterr().out
    on_disk = read_metrics(Path(run) / "metrics.jsonl")
    assert without_timings(on_disk) == without_timings(full)  # steps 2, 3 again
    assert main(["resume", run, "--checkpoint", "7"]) == 1
    assert "step_0007 is not a checkpoint" in capsys.readouterr().err


def test_ctrl_c_says_how_to_continue(recipe_file: Path, monkeypatch, capsys) -> None:
    def interrupted(self, step, rollout):
        raise KeyboardInterrupt

    monkeypatch.setattr(DiffusionLoop, "train_step", interrupted)
    assert main([str(recipe_file)]) == 130
    err = capsys.readouterr().err
    assert "interrupted; continue with: omni-train resume" in err and "Traceback" not in err


def test_learning_rate_schedules(train_dict) -> None:
    def rec(**sch):
        return recipe_from_dict(
            train_dict(optimizer={"lr": 1.0, "scheduler": sch}, trainer={"steps": 11})
        )

    assert [learning_rate(rec(), s) for s in (0, 10)] == [1.0, 1.0]
    warm = rec(name="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert [learning_rate(warm, s) for s in (0, 1)] == [0.5, 1.0]
    assert learning_rate(warm, 2) == pytest.approx(1.0)
    assert learning_rate(warm, 10) == pytest.approx(0.1)
    mid = 2 + (10 - 2) / 2
    assert learning_rate(warm, int(mid)) == pytest.approx(
        0.1 + 0.9 * (1 + math.cos(math.pi / 2)) / 2
    )
    lin = rec(name="linear")
    assert [round(learning_rate(lin, s), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    rows = train(
        recipe_from_dict(
            train_dict(
                optimizer={"lr": 1e-2, "scheduler": {"name": "linear", "warmup_steps": 1}},
                trainer={"steps": 3, "sample_every": 0},
            )
        )
    )
    assert [r["optim/lr"] for r in rows] == pytest.approx([1e-2, 1e-2, 0.0])


@pytest.mark.slow
def test_export_peft_diffusers_and_merged(train_dict, tiny_sd3: Path, tmp_path: Path) -> None:
    """The merged export loads as a plain model (no LoRA) and samples the trained run's
    validation images."""
    from diffusion_rollout import EmbeddedEngine, RolloutRequest
    from omni_adapters import from_pretrained
    from omni_train.checkpoint import latest_checkpoint, load_checkpoint
    from omni_train.models import load_policy, load_trainable
    from omni_train.seeds import DOMAIN_VAL, derive_seed

    d = train_dict(optimizer={"lr": 5e-2}, trainer={"steps": 2, "sample_every": 0, "val_every": 2})
    recipe = recipe_from_dict(d)
    train(recipe)
    run = Path(recipe.trainer.output_dir)
    for fmt, name in (
        ("peft", "adapter_config.json"),
        ("diffusers", "pytorch_lora_weights.safetensors"),
    ):
        out = tmp_path / fmt
        assert main(["export", str(run), "--format", fmt, "--out", str(out)]) == 0
        assert (out / name).is_file()
    merged = tmp_path / "merged"
    assert main(["export", str(run), "--format", "merged", "--out", str(merged)]) == 0
    plain = from_pretrained(merged)
    assert not any("lora" in n for n, _ in plain.model.named_parameters())
    # peft itself loads the peft export onto the base transformer: the merged model's output
    import peft
    import torch
    from diffusers import SD3Transformer2DModel

    base = SD3Transformer2DModel.from_pretrained(tiny_sd3 / "transformer")
    lora = peft.PeftModel.from_pretrained(base, tmp_path / "peft")
    c = base.config
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(1, c.in_channels, c.sample_size, c.sample_size, generator=g),
        "encoder_hidden_states": torch.randn(1, 8, c.joint_attention_dim, generator=g),
        "pooled_projections": torch.randn(1, c.pooled_projection_dim, generator=g),
        "timestep": torch.tensor([500.0]),
    }
    with torch.no_grad():
        got = lora(**inputs).sample
        torch.testing.assert_close(got, plain.model(**inputs).sample, atol=1e-4, rtol=1e-4)
        with lora.disable_adapter():
            assert not torch.allclose(lora(**inputs).sample, got, atol=1e-4)  # it is trained
    trained = load_policy(recipe)  # the run's policy, from its checkpoint
    ck = load_checkpoint(latest_checkpoint(run / "checkpoint"))
    load_trainable(trained, trained.named_trainable_parameters(), ck.trainable, recipe)
    params = recipe.sampling_params(
        sde_kind="ode", noise_level=0.0, sde_window_size=None, sde_window_range=None
    )
    reqs = [  # the run's validation requests
        RolloutRequest(p, derive_seed(recipe.trainer.seed, 0, i * 1000, DOMAIN_VAL), params)
        for i, p in enumerate(recipe.data.prompts[:2])
    ]
    outs = []
    for adapter in (trained, plain, from_pretrained(tiny_sd3)):
        with EmbeddedEngine(adapter) as engine:
            outs.append(engine.generate_many(reqs))
    trained_out, merged_out, base_out = outs
    for a, b in zip(trained_out, merged_out):
        assert float((a.final_latent - b.final_latent).abs().max()) < 1e-4
    assert any(  # and the LoRA did change the samples, so a wrong merge would show
        float((u.final_latent - a.final_latent).abs().max()) > 1e-3
        for u, a in zip(base_out, trained_out)
    )
