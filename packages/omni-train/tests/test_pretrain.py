"""`omni-train pretrain`: a few steps of flow-matching pretraining on the shapes world write a
toy SD3 that loads through omni_adapters.from_pretrained (the real diffusers/transformers
classes) and samples; the same seed gives the same weights."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import omni_adapters
from omni_rewards import shapes
from omni_train.cli import main
from omni_train.pretrain import (
    build_toy_sd3,
    ema_update,
    load_pretrain_config,
    sample_images,
    save_toy_sd3,
)
from omni_train.recipes_cli import recipes_root

TINY = [
    "model.layers=1",
    "model.heads=2",
    "model.head_dim=8",
    "model.vae_channels=8",
    "model.clip_hidden=8",
    "model.t5_d_model=16",
    "model.text_layers=1",
    "vae.steps=2",
    "vae.batch_size=4",
    "train.steps=3",
    "train.batch_size=4",
    "train.warmup_steps=2",
    "train.decay_steps=2",
    "train.timestep_shift=3",
    "train.task_weights.position=2",
    "sample.prompts=2",
    "sample.per_prompt=1",
    "sample.num_steps=2",
]


def _digest(model: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(model.rglob("*.safetensors")):
        for k, v in sorted(load_file(str(f)).items()):
            h.update(k.encode())
            h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()


@pytest.mark.slow
def test_pretrain_writes_a_model_that_loads_and_samples(tmp_path: Path, capsys) -> None:
    runs = {}
    ema = ["train.ema_decay=0.5", "train.save_every=2"]
    for name, seed, extra in (("a", 0, []), ("b", 0, []), ("c", 1, []), ("d", 0, ema)):
        out = tmp_path / name
        argv = ["pretrain", "shapes_sd3", *TINY, *extra, f"seed={seed}", f"output_dir={out}"]
        assert main(argv) == 0
        runs[name] = out
    printed = capsys.readouterr().out
    assert "held-out accuracy" in printed
    a = runs["a"]
    for f in ("metrics.jsonl", "loss_curve.png", "samples.png", "eval.json", "pretrain.yaml"):
        assert (a / f).is_file(), f
    rows = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["stage"] == "flow"] == [1, 2, 3]
    # warm-up over 2 steps, then the fall to 0 over the last 2 (it reaches 1/2 at the last)
    lr = load_pretrain_config("shapes_sd3").train.lr
    assert [r["lr"] for r in rows if r["stage"] == "flow"] == [lr / 2, lr, lr / 2]
    assert all(np.isfinite(r["loss"]) for r in rows if r["stage"] == "flow")
    ev = json.loads((a / "eval.json").read_text())
    assert ev["n"] == 2 and 0.0 <= ev["accuracy"] <= 1.0
    # deterministic given the seed; another seed gives other weights
    assert _digest(a / "model") == _digest(runs["b"] / "model")
    assert _digest(a / "model") != _digest(runs["c"] / "model")
    # the moving average is what is saved; training itself is untouched, also across the
    # checkpoint at step 2 that swaps the average in and the trained weights back
    d = runs["d"]
    assert (d / "checkpoints" / "step_2" / "model_index.json").is_file()
    assert _digest(d / "model") != _digest(a / "model")
    d_rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in d_rows if r["stage"] == "flow"] == [
        r["loss"] for r in rows if r["stage"] == "flow"
    ]
    assert type(omni_adapters.from_pretrained(d / "model")).__name__ == "SD3Adapter"

    adapter = omni_adapters.from_pretrained(a / "model")
    assert type(adapter).__name__ == "SD3Adapter"
    vae = adapter.component_config("vae")
    assert vae.scaling_factor != 1.0  # set from the latents' statistics after the VAE stage
    # the word-level tokenizers: one token per word of the grammar
    tok = adapter.components["tokenizer"]
    assert len(tok.tokenize("a yellow triangle right of a green square")) == 8
    imgs = sample_images(adapter, ["a red circle", "three blue squares"], [5, 6], num_steps=2)
    assert imgs.shape == (2, 32, 32, 3) and imgs.dtype == np.uint8
    again = sample_images(adapter, ["a red circle", "three blue squares"], [5, 6], num_steps=2)
    assert np.array_equal(imgs, again)

    # --evaluate: the held-out accuracy of a saved model, without training
    ev_dir = tmp_path / "ev"
    argv = ["pretrain", "shapes_sd3", "--evaluate", str(a / "model"), *TINY, f"output_dir={ev_dir}"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == {**json.loads((a / "eval.json").read_text()), "model": str(a / "model")}
    assert (ev_dir / "samples.png").is_file()
    assert main(["pretrain", "shapes_sd3", "--evaluate", str(tmp_path / "none")]) == 2
    assert "--evaluate" in capsys.readouterr().err

    # the quickstart (MixGRPO on the toy world) runs on such a model (2 steps, validated on
    # the held-out colour pairs), and `omni-train eval` scores the run's LoRA with the shapes
    # reward
    recipes = recipes_root()
    data = recipes / "data" / "shapes"
    run = tmp_path / "rl"
    argv = [
        str(recipes / "quickstart.yaml"),
        f"model.path={a / 'model'}",
        f"data.file={data / 'colors_train.txt'}",
        f"data.val_file={data / 'colors_heldout.txt'}",
        "data.prompts_per_step=2",
        "rollout.n=2",
        "rollout.num_steps=3",
        "rollout.sde_window_size=1",
        "rollout.sde_window_range=[0,2]",
        "trainer.steps=2",
        "trainer.val_every=2",
        "trainer.val_num_steps=2",
        "trainer.val_samples_per_prompt=1",
        "trainer.progress=false",
        f"trainer.output_dir={run}",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(argv) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # the reward's per-task columns of task types the batch does not hold are NaN (null in
    # metrics.jsonl), quietly: np.nanmean would warn "Mean of empty slice" at every step
    assert not [w for w in caught if "empty slice" in str(w.message)]
    step = next(r for r in rows if "reward/mean" in r)
    assert step["reward/task_counting_mean"] is None
    assert 0 <= step["reward/task_colors_mean"] <= 1
    val = [r for r in rows if "val/reward_mean" in r]
    assert [r["step"] for r in val] == [0, 2]
    assert all(0.0 <= r["val/reward_mean"] <= 1.0 for r in val)
    assert "val/task_colors_mean" in val[-1]
    capsys.readouterr()
    argv = ["eval", str(run), "--prompts", str(data / "colors_heldout.txt"), "--reward", "shapes"]
    argv += ["--n", "1", "--out", str(tmp_path / "ev_rl"), "--no-progress"]
    assert main(argv) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev["kind"] == "run" and ev["count"] == 4 and set(ev["per_task"]) == {"colors"}


def _tensor_shapes(model: Path) -> dict[str, dict[str, tuple[int, ...]]]:
    """{file relative to the model folder: {tensor name: shape}} of a saved pipeline."""
    return {
        f.relative_to(model).as_posix(): {k: v.shape for k, v in load_file(str(f)).items()}
        for f in sorted(model.rglob("*.safetensors"))
    }


@pytest.mark.slow
def test_the_shipped_toy_model_is_what_its_card_says(tmp_path: Path, capsys) -> None:
    """recipes/models/shapes_sd3 (the quickstart's base): its weights are the ones its
    README's digest names, its architecture and tokenizers are the shipped pretraining
    config's, and it draws single coloured objects (`omni-train eval`, the card's command)."""
    shipped = recipes_root() / "models" / "shapes_sd3"
    assert _digest(shipped) in (shipped / "README.md").read_text()
    cfg = load_pretrain_config("shapes_sd3", [f"output_dir={tmp_path}"])
    fresh = save_toy_sd3(build_toy_sd3(cfg.model, shapes.vocabulary(), cfg.seed), tmp_path / "m")
    assert _tensor_shapes(shipped) == _tensor_shapes(fresh)
    for tok in ("tokenizer", "tokenizer_2", "tokenizer_3"):  # the grammar's words, same ids
        want, got = (json.loads((m / tok / "tokenizer.json").read_text()) for m in (fresh, shipped))
        assert got["model"] == want["model"] and got["added_tokens"] == want["added_tokens"], tok
    prompts = recipes_root() / "data" / "shapes" / "colors_heldout.txt"
    argv = ["eval", str(shipped), "--prompts", str(prompts), "--reward", "shapes", "--n", "8"]
    argv += ["--seed", "7", "--out", str(tmp_path / "ev"), "--no-progress"]
    argv += ["rollout.height=32", "rollout.width=32", "rollout.num_steps=16"]
    assert main(argv) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the card measured 0.477 with 32 samples a prompt; a random model of this size scores 0
    assert ev["count"] == 32 and ev["mean"] >= 0.25, ev


def test_ema_update_follows_its_formula() -> None:
    import torch

    ema, params = [torch.zeros(3)], [torch.ones(3)]
    ema_update(ema, params, 0.999, step=0)  # warm-up: d = min(0.999, 1 / 10)
    assert torch.allclose(ema[0], torch.full((3,), 0.9))
    ema_update(ema, params, 0.5, step=1000)  # d = 0.5
    assert torch.allclose(ema[0], torch.full((3,), 0.95))
    assert torch.equal(params[0], torch.ones(3))


def test_pretrain_config_errors_name_the_key(tmp_path: Path, capsys) -> None:
    assert main(["pretrain", "shapes_sd3", "train.stepz=3"]) == 2
    assert "train.stepz" in capsys.readouterr().err
    assert main(["pretrain", "shapes_sd3", "model.image_size=30"]) == 2
    assert "model.image_size" in capsys.readouterr().err
    assert main(["pretrain", "shapes_sd3", "train.timestep_shift=0"]) == 2
    assert "train.timestep_shift" in capsys.readouterr().err
    assert load_pretrain_config("shapes_sd3", ["split=all"]).split == "all"
    assert main(["pretrain", "shapes_sd3", "split=every"]) == 2
    assert "split" in capsys.readouterr().err
    assert main(["pretrain", "shapes_sd3", "train.ema_decay=1"]) == 2
    assert "train.ema_decay" in capsys.readouterr().err
    assert main(["pretrain", "shapes_sd3", "train.task_weights.shapes=2"]) == 2
    err = capsys.readouterr().err
    assert "train.task_weights" in err and "unknown task type 'shapes'" in err
    weighted = load_pretrain_config("shapes_sd3", ["train.task_weights.position=3"])
    assert weighted.train.task_weights == {"position": 3.0}
    assert main(["pretrain", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    cfg = load_pretrain_config("shapes_sd3", ["train.steps=7"])
    assert cfg.train.steps == 7 and cfg.world == "shapes"
