"""`omni-train recipes list|copy` and `omni-train --version`: the recipes a pip install carries.

The wheel test builds omni-train's wheel with uv (as `nox -s standalone` does) and checks that
every recipe of the repository is inside it; the standalone run of this file then exercises
`recipes_root()` on the installed wheel's copy, the workspace run on the checkout's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from omni_train.cli import main
from omni_train.recipes_cli import copy_recipe, recipes_root, shipped_recipes

REPO = Path(__file__).resolve().parents[3]
REPO_RECIPES = sorted(
    p.relative_to(REPO / "recipes").with_suffix("").as_posix()
    for p in (REPO / "recipes").rglob("*.yaml")
    if p.relative_to(REPO / "recipes").parts[0] not in ("data", "models")
)


def test_list_names_every_recipe(capsys) -> None:
    assert main(["recipes", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == REPO_RECIPES
    quickstart = next(line for line in lines if line.startswith("quickstart "))
    assert "shapes_sd3, mix_grpo, reward shapes, LoRA r16" in quickstart
    # what recipes_root() holds is the repository's recipes, byte for byte
    for recipe in shipped_recipes():
        source = REPO / "recipes" / recipe.path.relative_to(recipes_root())
        assert recipe.path.read_bytes() == source.read_bytes(), recipe.name


def test_copy_then_validate_from_that_folder(tmp_path, monkeypatch, capsys) -> None:
    """`recipes copy` puts the recipe where its comments say (recipes/NAME.yaml), with the
    recipes/data folder it reads, so `omni-train validate` passes from that folder alone."""
    monkeypatch.chdir(tmp_path)
    assert main(["recipes", "copy", "quickstart"]) == 0
    assert main(["recipes", "copy", "cpu/qwen_image_edit_lora_flowgrpo"]) == 0
    out = capsys.readouterr().out
    assert "run it: omni-train recipes/quickstart.yaml" in out
    copied = tmp_path / "recipes" / "quickstart.yaml"
    assert copied.read_bytes() == (REPO / "recipes" / "quickstart.yaml").read_bytes()
    edit_data = tmp_path / "recipes" / "data" / "edit_tiny"
    shipped = sorted(
        p.relative_to(REPO / "recipes/data/edit_tiny").as_posix()
        for p in (REPO / "recipes/data/edit_tiny").rglob("*")
    )
    assert sorted(p.relative_to(edit_data).as_posix() for p in edit_data.rglob("*")) == shipped
    assert main(["validate", "recipes/quickstart.yaml"]) == 0
    edit = Path("recipes/cpu/qwen_image_edit_lora_flowgrpo.yaml")
    assert main(["validate", str(edit)]) == 0
    # the data file the copied recipe names, and every image its rows name, exist from here
    data_file = Path(yaml.safe_load(edit.read_text())["data"]["file"])
    rows = [json.loads(line) for line in data_file.read_text().splitlines()]
    assert rows and all((data_file.parent / row["image"]).is_file() for row in rows)
    # the quickstart trains the shipped toy model: the model folder (recipes/models/) and the
    # prompt files come with it
    model = Path(yaml.safe_load(copied.read_text())["model"]["path"])
    assert model == Path("recipes/models/shapes_sd3")
    shipped = REPO / model
    assert sorted(p.relative_to(model).as_posix() for p in model.rglob("*")) == sorted(
        p.relative_to(shipped).as_posix() for p in shipped.rglob("*")
    )
    assert Path(yaml.safe_load(copied.read_text())["data"]["val_file"]).is_file()


def test_copy_refuses_to_overwrite_and_names_the_file(tmp_path, capsys) -> None:
    target = tmp_path / "recipes" / "quickstart.yaml"
    target.parent.mkdir()
    target.write_text("# my edits\n")
    assert main(["recipes", "copy", "quickstart", "--to", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omni-train: error: recipes copy:") and str(target) in err
    assert "--force" in err
    assert target.read_text() == "# my edits\n"  # nothing changed
    written = copy_recipe("quickstart", tmp_path, force=True)
    recipes = tmp_path / "recipes"
    assert written == [target, recipes / "data" / "shapes", recipes / "models" / "shapes_sd3"]
    assert target.read_bytes() == (REPO / "recipes" / "quickstart.yaml").read_bytes()


def test_copy_names_a_missing_dataset_and_the_command_that_makes_it(tmp_path, capsys) -> None:
    assert main(["recipes", "copy", "sd35_ocr_lora_flowgrpo", "--to", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"run it: cd {tmp_path} && omni-train prepare ocr && " in out


def test_unknown_recipe_suggests_the_closest(capsys) -> None:
    assert main(["recipes", "copy", "quickstrat"]) == 2
    err = capsys.readouterr().err
    assert "no recipe 'quickstrat' (did you mean 'quickstart'?)" in err
    assert err.count("\n") == 1


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"omni-train {metadata.version('omni-train')} (omni-algos ")
    assert f"torch {metadata.version('torch')}" in out


def test_the_wheel_carries_every_recipe(tmp_path) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (it builds the wheel)")
    subprocess.run(
        [uv, "build", "--package", "omni-train", "--wheel", "--out-dir", str(tmp_path), "-q"],
        cwd=REPO,
        check=True,
        timeout=600,
    )
    (wheel,) = tmp_path.glob("omni_train-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for rel in REPO_RECIPES:
        assert f"omni_train/recipes/{rel}.yaml" in names, rel
    data = [p for d in ("data", "models") for p in (REPO / "recipes" / d).rglob("*") if p.is_file()]
    assert any(p.name == "diffusion_pytorch_model.safetensors" for p in data)  # recipes/models
    for path in data:
        assert f"omni_train/recipes/{path.relative_to(REPO / 'recipes').as_posix()}" in names
