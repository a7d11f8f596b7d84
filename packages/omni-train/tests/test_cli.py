from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omni_train.cli import main

REPO = Path(__file__).resolve().parents[3]


def test_validate_ok(recipe_file: Path, capsys) -> None:
    assert main(["validate", str(recipe_file)]) == 0
    out = capsys.readouterr().out
    assert "is a valid recipe" in out
    assert "will be built" in out


def test_validate_shipped_recipes(capsys) -> None:
    for p in sorted((REPO / "recipes").glob("**/*.yaml")):
        assert main(["validate", str(p)]) == 0, p


def test_bad_key_one_clear_message(recipe_file: Path, capsys) -> None:
    assert main(["validate", str(recipe_file), "rollout.nn=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omni-train: error:")
    assert "did you mean 'rollout.n'" in err
    assert "Traceback" not in err


def test_unknown_loss_and_reward(recipe_file: Path, capsys) -> None:
    assert main(["validate", str(recipe_file), "algorithm.name=nope"]) == 2
    assert "algorithm.name: unknown algorithm 'nope'" in capsys.readouterr().err
    assert main(["validate", str(recipe_file), "reward.name=nope"]) == 2
    assert "reward.name: unknown reward 'nope'" in capsys.readouterr().err
    assert main(["validate", str(recipe_file), "algorithm.name=flowgrpo"]) == 2
    assert "unknown algorithm 'flowgrpo' (did you mean 'flow_grpo'?)" in capsys.readouterr().err
    assert main(["validate", str(recipe_file), "reward.name=pickscorr"]) == 2
    assert "unknown reward 'pickscorr' (did you mean 'pickscore'?)" in capsys.readouterr().err


def test_size_the_model_cannot_take(recipe_file: Path, capsys) -> None:
    """An image size off the model's latent grid fails at setup naming the key, no traceback."""
    assert main([str(recipe_file), "rollout.height=33", "trainer.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "rollout.height: 33 is not a positive multiple of" in err
    assert "Traceback" not in err


def test_missing_recipe_and_bad_yaml(tmp_path: Path, capsys) -> None:
    assert main(["validate", str(tmp_path / "none.yaml")]) == 2
    assert "recipe file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert main([str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_missing_model_path_from_cli(recipe_file: Path, tmp_path: Path, capsys) -> None:
    d = yaml.safe_load(recipe_file.read_text())
    d["model"] = {"path": str(tmp_path / "nope")}
    recipe_file.write_text(yaml.safe_dump(d))
    assert main([str(recipe_file)]) == 1
    err = capsys.readouterr().err
    assert "model.path:" in err and "does not exist" in err and "Traceback" not in err


def test_resume_not_a_run(tmp_path: Path, capsys) -> None:
    assert main(["resume", str(tmp_path)]) == 1
    assert "not a run folder" in capsys.readouterr().err


def test_console_script_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "omni_train.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0
    assert "omni-train validate RECIPE" in out.stdout


def test_report_writes_html(train_dict, capsys) -> None:
    from omni_train import train
    from omni_train.recipe import recipe_from_dict

    d = train_dict()
    d["trainer"].update(steps=2, val_every=1)
    recipe = recipe_from_dict(d)
    train(recipe)  # rows: the step-0 validation baseline (no reward/mean), steps 1 and 2
    assert main(["report", recipe.trainer.output_dir]) == 0
    page = (Path(recipe.trainer.output_dir) / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 3  # reward curve, other curves, samples
    assert re.search(r"reward mean: -?[0-9.]+ \(step 1\) -&gt; -?[0-9.]+ \(step 2\)", page)
    assert re.search(r"validation reward: -?[0-9.]+ \(step 0\) -&gt; -?[0-9.]+ \(step 2\)", page)
    assert "step_0001" in page
    # what `omni-train RECIPE` prints when the run ends
    from omni_train.report import run_summary

    run = recipe.trainer.output_dir
    lines = run_summary(run)
    assert lines[0] == f"finished: 2 steps in {run}", lines
    assert any(
        re.fullmatch(r"  validation reward: \S+ \(step 0\) -> \S+ \(step 2\)", x) for x in lines
    )
    assert f"  next: omni-train report {run}  (one HTML page: curves, sample grids)" in lines


def test_validate_memory_estimates_a_gpu_recipe(capsys) -> None:
    recipe = REPO / "recipes" / "wan22_t2v_dancegrpo.yaml"
    assert main(["validate", "--memory", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "Wan-AI/Wan2.2-TI2V-5B-Diffusers" in out
    # the released TI2V-5B transformer with the recipe's LoRA (r64 on 30 blocks x 8 projections)
    assert "trainable WanTransformer3DModel: 5.00B parameters; LoRA r64 on 240 modules" in out
    assert "one training forward: 16 rows x 4022 tokens through 30 layers of width 3072" in out
    assert "total per GPU" in out and "fits in 80 GiB (A100/H100 80 GB):" in out
    assert "fits in 141 GiB (H200):" in out
    # with rows_per_forward auto: the first update at max_num_seqs, then what the memory holds
    assert main(["validate", "--memory", str(recipe), "algorithm.rows_per_forward=auto"]) == 0
    out = capsys.readouterr().out
    assert "one training forward: 16 rows x 4022 tokens" in out
    auto = re.findall(r"rows_per_forward auto: (\d+) from the second update on", out)
    assert len(auto) == 2 and int(auto[0]) < int(auto[1])  # 80 GiB, then 141 GiB


def test_validate_memory_errors_name_the_key(tmp_path: Path, capsys) -> None:
    recipe = REPO / "recipes" / "wan22_t2v_dancegrpo.yaml"
    assert main(["validate", "--memory", str(recipe), f"model.path={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err
    assert "model.path:" in err and "pass --published NAME" in err
    assert main(["validate", "--memory", str(recipe), "--published", "nope"]) == 2
    assert "--published: published: unknown model 'nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_validate_memory_every_shipped_gpu_recipe(capsys) -> None:
    for p in sorted((REPO / "recipes").glob("*.yaml")):
        if p.stem == "quickstart":  # the toy model: no published sizes to estimate from
            continue
        assert main(["validate", "--memory", str(p)]) == 0, p
        out = capsys.readouterr().out
        assert "total per GPU" in out and "fits in 141 GiB" in out, p
    # a tiny random model is a CPU recipe: --memory says so instead of estimating
    tiny = REPO / "recipes" / "tiny" / "sd3_brightness_flowgrpo.yaml"
    assert main(["validate", "--memory", str(tiny)]) == 0
    assert "is a CPU model; --memory is for GPU recipes" in capsys.readouterr().out
