from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from omni_train.cli import main
from omni_train.data import PromptData, read_prompt_file
from omni_train.prepare import DATASETS, prepare
from omni_train.recipe import RecipeError


def test_prepare_every_dataset(tmp_path: Path) -> None:
    for name in DATASETS:
        paths = prepare(name, tmp_path / name)
        train = read_prompt_file(paths["train"])
        test = read_prompt_file(paths["test"])
        assert len(train) > len(test) > 0
        assert not set(train) & set(test)
    ocr = [json.loads(line) for line in (tmp_path / "ocr" / "train.jsonl").open()]
    assert all(f'"{row["reference"]}"' in row["prompt"] for row in ocr)
    assert prepare("ocr", tmp_path / "again")["train"].read_text() == paths_text(tmp_path)


def paths_text(tmp_path: Path) -> str:
    return (tmp_path / "ocr" / "train.jsonl").read_text()


def test_prepare_cli(tmp_path: Path, capsys) -> None:
    assert main(["prepare", "pickscore", "--out", str(tmp_path / "ps")]) == 0
    assert "train prompts" in capsys.readouterr().out
    assert main(["prepare", "nope"]) == 2
    assert "unknown dataset 'nope'" in capsys.readouterr().err


def test_bad_rows_reported_by_line(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "ok"}\n\n{"prompt": 3}\n')
    with pytest.raises(RecipeError, match=re.escape("line 3: needs a string 'prompt' field")):
        read_prompt_file(p)
    p.write_text('{"prompt": "ok"}\n{oops\n')
    with pytest.raises(RecipeError, match=re.escape("line 2: not valid JSON")):
        read_prompt_file(p)
    with pytest.raises(RecipeError, match="does not exist"):
        read_prompt_file(tmp_path / "missing.jsonl")


def test_recipe_with_data_file(recipe_dict, tmp_path: Path) -> None:
    from omni_train.recipe import recipe_from_dict

    paths = prepare("ocr", tmp_path / "ocr")
    d = recipe_dict()
    d["data"] = {"file": str(paths["train"]), "prompts_per_step": 3}
    r = recipe_from_dict(d)
    data = PromptData.from_config(r.data, seed=0)
    assert len(data.prompts_for_step(0)) == 3
    assert all('"' in p for p in data.prompts_for_step(5))
