"""`omni-train eval`: deterministic ODE samples of a run's policy or a base model, scored."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from omni_train.cli import main
from omni_train.evaluate import evaluate, summarize

#: a tiny SD3 at 32x32 in 4 steps (the model folder has no recipe: these are flags)
REPO = Path(__file__).resolve().parents[3]
SMALL = ["rollout.height=32", "rollout.width=32", "rollout.num_steps=4"]
KEYS = {
    "target",
    "kind",
    "checkpoint",
    "prompts",
    "reward",
    "n",
    "seed",
    "num_steps",
    "height",
    "width",
    "out",
    "count",
    "mean",
    "std",
    "stderr",
    "per_prompt",
    "details",
    "per_task",
    "diversity",
}


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.txt"
    p.write_text("a red square\n\na blue circle\n")
    return p


def _eval_cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["eval", *args, "--no-progress"])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_same_seed_same_json_grid_and_keys(
    tiny_sd3: Path, prompt_file: Path, tmp_path: Path, capsys
) -> None:
    """One JSON object on stdout, the same for the same command; eval.json holds it; the grid
    has a block per prompt (its title, its samples); another seed samples other images."""
    out = tmp_path / "out"
    args = [str(tiny_sd3), "--prompts", str(prompt_file), "--reward", "brightness"]
    args += ["--n", "3", "--seed", "7", "--out", str(out), *SMALL]
    rc, first, _ = _eval_cli(capsys, *args)
    assert rc == 0
    result = json.loads(first)  # the whole of stdout is one JSON object
    assert set(result) == KEYS
    assert result["kind"] == "model" and result["checkpoint"] is None
    assert result["count"] == 6 and result["n"] == 3 and result["seed"] == 7
    assert [p["prompt"] for p in result["per_prompt"]] == ["a red square", "a blue circle"]
    scores = [s for p in result["per_prompt"] for s in p["scores"]]
    assert len(set(scores)) == 6  # distinct seeds, distinct images
    assert [p["distinct"] for p in result["per_prompt"]] == [3, 3]
    assert result["diversity"] > 0.5  # a random model: the seeds make the images
    assert result["mean"] == pytest.approx(np.mean(scores), abs=1e-9)
    assert result["per_prompt"][0]["mean"] == pytest.approx(np.mean(scores[:3]), abs=1e-9)
    assert result["stderr"] == pytest.approx(np.std(scores) / np.sqrt(6), abs=1e-9)
    assert json.loads((out / "eval.json").read_text()) == result
    grid = Image.open(out / "grid.png")
    # save_prompt_grid: 32 px tiles upscaled x3, 2 px gaps; two blocks of 3 fit a row of 8, each
    # a title line, the tiles and a caption line
    assert grid.size == (2 * (3 * (96 + 2) + 4) + 2, (12 + 96 + 12 + 2) + 4 + 2)

    rc, second, _ = _eval_cli(capsys, *args)
    assert rc == 0 and second == first
    rc, other, _ = _eval_cli(capsys, *[a if a != "7" else "8" for a in args])
    assert rc == 0 and json.loads(other)["mean"] != result["mean"]


def test_reward_details_are_averaged(tiny_sd3: Path, prompt_file: Path, tmp_path: Path) -> None:
    """color_match's numeric per-sample `distance` is averaged; its (B, 3) target is not."""
    result = evaluate(
        tiny_sd3,
        prompt_file,
        reward="color_match",
        n=2,
        out=tmp_path / "o",
        overrides=SMALL,
        progress=False,
    )
    assert set(result["details"]) == {"distance"}
    assert 0.0 <= result["details"]["distance"] <= 1.0
    assert result["per_task"] == {}


def test_shapes_reward_per_task(tiny_sd3: Path, tmp_path: Path) -> None:
    """The shapes reward's per-task details reach eval's per_task, one entry per task type
    of the prompts (held-out prompts of the shapes world)."""
    from omni_rewards.shapes import task_types

    lines = (REPO / "recipes" / "data" / "shapes" / "heldout.txt").read_text().splitlines()
    prompts = [p for p in lines if p.strip()][:: max(1, len(lines) // 6)][:6]
    f = tmp_path / "p.txt"
    f.write_text("\n".join(prompts) + "\n")
    result = evaluate(
        tiny_sd3, f, reward="shapes", n=1, out=tmp_path / "o", overrides=SMALL, progress=False
    )
    types = task_types(prompts)
    assert set(result["per_task"]) == set(types)
    assert sum(v["count"] for v in result["per_task"].values()) == len(prompts)
    assert {"count", "object", "colour", "position"} <= set(result["details"])


def test_summarize_task_types_and_nan_details() -> None:
    """Per-task means from `task_<type>` details (NaN where a sample is of another type; also
    a MultiReward term's `x/task_<type>`); NaN details are left out of their mean."""
    scores = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    nan = np.nan
    details = {
        "shapes/task_counting": np.array([1.0, 0.0, nan, nan, nan, nan]),
        "shapes/task_position": np.array([nan, nan, 1.0, nan, nan, nan]),
        "task_colors": np.array([nan, nan, nan, 1.0, 0.0, 0.0]),
        "count_ok": np.array([1.0, 0.0, nan, nan, nan, nan]),
        "never": np.full(6, nan),
        "rgb": np.zeros((6, 3)),
    }
    s = summarize(["a", "b", "c"], scores, details, n=2)
    assert s["per_task"] == {
        "colors": {"mean": pytest.approx(1 / 3), "count": 3},
        "counting": {"mean": 0.5, "count": 2},
        "position": {"mean": 1.0, "count": 1},
    }
    assert s["details"]["count_ok"] == 0.5 and s["details"]["never"] is None
    assert [p["mean"] for p in s["per_prompt"]] == [0.5, 1.0, 0.0]
    assert s["count"] == 6 and s["mean"] == 0.5


def test_bad_arguments_name_the_argument(
    tiny_sd3: Path, prompt_file: Path, tmp_path: Path, train_dict, capsys
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    no_ckpt = tmp_path / "fresh_run"
    no_ckpt.mkdir()
    (no_ckpt / "recipe.yaml").write_text(yaml.safe_dump(train_dict()))
    model, prompts = str(tiny_sd3), str(prompt_file)
    cases = [
        ([str(tmp_path / "nope"), "--prompts", prompts], "RUN_OR_MODEL: "),
        ([str(tmp_path), "--prompts", prompts], "RUN_OR_MODEL: "),  # neither run nor model
        ([str(no_ckpt), "--prompts", prompts], "has no checkpoint that verifies"),
        ([model, "--prompts", str(empty), "--reward", "brightness"], "--prompts"),
        ([model, "--prompts", str(tmp_path / "x.txt"), "--reward", "brightness"], "--prompts"),
        ([model, "--prompts", prompts, "--reward", "brightnes"], "--reward: unknown reward"),
        ([model, "--prompts", prompts], "--reward: "),  # a bare model needs a reward
        ([model, "--prompts", prompts, "--reward", "brightness", "--n", "0"], "--n: "),
        ([model, "--prompts", prompts, "--recipe", str(tmp_path / "r.yaml")], "--recipe: "),
        (
            [str(no_ckpt), "--prompts", prompts, "--recipe", str(no_ckpt / "recipe.yaml")],
            "--recipe",
        ),
    ]
    for args, needle in cases:
        rc, out, err = _eval_cli(capsys, *args)
        assert rc in (1, 2), args
        assert out == "", args
        assert err.startswith("omni-train: error:") and needle in err, (args, err)
        assert "Traceback" not in err
    rc, _, err = _eval_cli(capsys, *cases[5][0])
    assert "did you mean 'brightness'?" in err


def test_eval_of_a_run_reproduces_its_validation(
    train_dict, tiny_sd3: Path, tmp_path: Path, capsys
) -> None:
    """A trained run evaluated on its val_file with the defaults (seed trainer.seed, n
    val_samples_per_prompt) scores exactly what the run's last validation scored with the
    live policy: the LoRA loaded from the checkpoint is the trained one. The base model, with
    the run's recipe, scores what the run's step-0 validation scored, and differs."""
    from safetensors.torch import load_file

    from omni_train.checkpoint import latest_checkpoint
    from omni_train.evaluate import eval_recipe, load_run_policy
    from omni_train.logger import read_metrics
    from omni_train.recipe import recipe_from_dict
    from omni_train.train import train

    val = tmp_path / "val.jsonl"
    val.write_text('{"prompt": "a green field"}\n{"prompt": "a yellow sun"}\n')
    d = train_dict(
        optimizer={"lr": 5e-2},
        data={"val_file": str(val)},
        trainer={"steps": 2, "sample_every": 0, "val_every": 2, "val_samples_per_prompt": 2},
    )
    train(recipe_from_dict(d))
    capsys.readouterr()  # the run's console lines
    run = Path(d["trainer"]["output_dir"])
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "val/reward_mean" in r]
    base_val, trained_val = rows[0], rows[-1]
    assert base_val["step"] == 0 and trained_val["step"] == 2

    rc, out, _ = _eval_cli(capsys, str(run), "--prompts", str(val))
    assert rc == 0
    trained = json.loads(out)
    assert trained["kind"] == "run" and trained["checkpoint"].endswith("step_0002")
    assert trained["count"] == 4 and trained["out"] == str(run / "eval" / "val")
    assert trained["mean"] == pytest.approx(trained_val["val/reward_mean"], abs=1e-6)
    assert (run / "eval" / "val" / "grid.png").is_file()

    rc, out, _ = _eval_cli(
        capsys,
        str(tiny_sd3),
        "--prompts",
        str(val),
        "--recipe",
        str(run / "recipe.yaml"),
        "--out",
        str(tmp_path / "base"),
    )
    assert rc == 0
    base = json.loads(out)
    assert base["kind"] == "model"
    assert base["mean"] == pytest.approx(base_val["val/reward_mean"], abs=1e-6)
    # the LoRA changed the images (one uint8 level of one pixel moves brightness by 3.8e-6)
    diffs = [
        abs(a - b)
        for pa, pb in zip(base["per_prompt"], trained["per_prompt"])
        for a, b in zip(pa["scores"], pb["scores"])
    ]
    assert max(diffs) > 1e-5, diffs

    # the policy eval samples carries the checkpoint's LoRA, the tensors `export` writes
    recipe, _ = eval_recipe(run)
    ck = latest_checkpoint(run / "checkpoint")
    policy = load_run_policy(recipe, ck)
    exported = load_file(str(ck / "lora" / "adapter_model.safetensors"))
    loaded = policy.export_rollout_weights(fmt="peft")
    assert set(loaded) == set(exported)
    for k, v in exported.items():
        assert np.array_equal(loaded[k].float().numpy(), v.float().numpy()), k


@pytest.mark.parametrize("kind", ["ema", "full"])
def test_eval_of_ema_and_full_finetune_runs(kind: str, train_dict, tmp_path: Path, capsys) -> None:
    """An EMA run is evaluated with its EMA weights (what its validation samples; the live
    LoRA, `optimizer.ema_decay=0`, scores otherwise); a full fine-tuning run with its whole
    trained component. Both reproduce the run's last validation."""
    from omni_train.logger import read_metrics
    from omni_train.recipe import recipe_from_dict
    from omni_train.train import train

    val = tmp_path / "val.txt"
    val.write_text("a green field\na yellow sun\n")
    sections: dict = {
        "data": {"val_file": str(val)},
        "trainer": {"steps": 2, "sample_every": 0, "val_every": 2},
    }
    if kind == "ema":
        sections["optimizer"] = {"lr": 5e-2, "ema_decay": 0.5}
    else:
        sections["optimizer"] = {"lr": 1e-3}
    d = train_dict(**sections)
    if kind == "full":
        d["lora"] = {"enabled": False}
    train(recipe_from_dict(d))
    capsys.readouterr()
    run = Path(d["trainer"]["output_dir"])
    first, *_, last = [r for r in read_metrics(run / "metrics.jsonl") if "val/reward_mean" in r]
    assert abs(first["val/reward_mean"] - last["val/reward_mean"]) > 1e-6  # training moved it

    rc, out, _ = _eval_cli(capsys, str(run), "--prompts", str(val))
    assert rc == 0
    result = json.loads(out)
    assert result["mean"] == pytest.approx(last["val/reward_mean"], abs=1e-6)
    if kind == "ema":
        rc, out, _ = _eval_cli(
            capsys,
            str(run),
            "--prompts",
            str(val),
            "--out",
            str(tmp_path / "live"),
            "optimizer.ema_decay=0",
        )
        assert rc == 0
        live = [s for p in json.loads(out)["per_prompt"] for s in p["scores"]]
        ema = [s for p in result["per_prompt"] for s in p["scores"]]
        assert max(abs(a - b) for a, b in zip(live, ema)) > 1e-5
