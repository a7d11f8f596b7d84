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


# ------------------------------------------------------------------ images, Parquet, edit sets
def _png(path: Path, rgb=(10, 20, 30), size=(6, 4), mode="RGB") -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, rgb if mode == "RGB" else rgb[0]).save(path)
    return path


def test_jsonl_rows_carry_images_aligned_with_prompts(tmp_path: Path) -> None:
    import numpy as np

    from omni_train.recipe import DataConfig

    for i in range(5):
        _png(tmp_path / "img" / f"{i}.png", (i * 40, 0, 0))
    _png(tmp_path / "img" / "gray.png", (77,), mode="L")
    rows = [{"prompt": f"edit {i}", "image": f"img/{i}.png"} for i in range(5)]
    rows.append({"prompt": "gray", "image": str(tmp_path / "img" / "gray.png")})  # absolute
    p = tmp_path / "edit.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = PromptData.from_config(DataConfig(file=str(p), prompts_per_step=4), seed=3)
    assert data.has_images and data.missing_image() is None
    for step in range(4):  # crosses an epoch boundary
        prompts, images = data.prompts_for_step(step), data.images_for_step(step)
        assert len(images) == 4
        for prompt, img in zip(prompts, images):
            assert img.dtype == np.uint8 and img.shape == (4, 6, 3)
            if prompt == "gray":
                assert (img == 77).all()  # grayscale PNG loaded as RGB
            else:
                assert img[0, 0, 0] == int(prompt.split()[1]) * 40
    again = PromptData.from_config(DataConfig(file=str(p), prompts_per_step=4), seed=3)
    assert again.rows_for_step(7) == data.rows_for_step(7)  # pure function of (seed, step)
    assert data.prompts_for_step(2) == [data.prompts[j] for j in data.rows_for_step(2)]
    assert (data.val_image(7) == data.image(1)).all()
    text = PromptData(["a", "b"], 1, 0)
    assert not text.has_images and "text only" in text.missing_image()


def test_bad_image_rows_reported_by_line(tmp_path: Path) -> None:
    from omni_train.data import read_data_file
    from omni_train.recipe import DataConfig

    _png(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    p = tmp_path / "d.jsonl"
    cases = [
        (
            '{"prompt": "a", "image": "ok.png"}\n{"prompt": "b", "image": "gone.png"}\n',
            "line 2: image .*gone.png does not exist",
        ),
        ('{"prompt": "a", "image": 3}\n', "line 1: 'image' must be a PNG/JPEG path"),
        ('\n{"prompt": "a", "image": "broken.png"}\n', "line 2: image .*broken.png"),
    ]
    for text, match in cases:
        p.write_text(text)
        with pytest.raises(RecipeError, match=match):
            read_data_file(p)
    p.write_text('{"prompt": "a", "image": "ok.png"}\n{"prompt": "b"}\n')
    data = PromptData.from_config(DataConfig(file=str(p)), 0)
    assert not data.has_images and "prompt 'b' has no 'image'" in data.missing_image()


def test_parquet_rows_with_path_bytes_and_struct_images(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from omni_train.data import read_data_file
    from omni_train.recipe import DataConfig

    png = _png(tmp_path / "a.png", (200, 100, 0)).read_bytes()
    _png(tmp_path / "sub" / "b.png", (0, 0, 255))
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["x", "y"], "image": [png, None], "extra": [1, 2]}), p)
    rows = read_data_file(p)
    assert [r.prompt for r in rows] == ["x", "y"] and rows[1].image is None
    assert tuple(rows[0].image.load()[0, 0]) == (200, 100, 0)
    pq.write_table(pa.table({"prompt": ["x", "y"], "image": ["a.png", "sub/b.png"]}), p)
    data = PromptData.from_config(DataConfig(file=str(p), prompts_per_step=2), 0)
    assert data.has_images and tuple(data.image(1)[0, 0]) == (0, 0, 255)
    hf = [{"bytes": png, "path": None}, {"bytes": None, "path": "sub/b.png"}]  # datasets Image
    pq.write_table(pa.table({"prompt": ["x", "y"], "image": hf}), p)
    assert [tuple(r.image.load()[0, 0]) for r in read_data_file(p)] == [(200, 100, 0), (0, 0, 255)]
    pq.write_table(pa.table({"prompt": ["ok", None]}), p)
    with pytest.raises(RecipeError, match=r"row 1 \(0-based\): 'prompt' must be a string"):
        read_data_file(p)
    pq.write_table(pa.table({"prompt": ["ok", "ok"], "image": [png, b"junk"]}), p)
    with pytest.raises(RecipeError, match=r"row 1 \(0-based\): image bytes"):
        read_data_file(p)
    pq.write_table(pa.table({"text": ["ok"]}), p)
    with pytest.raises(RecipeError, match="needs a 'prompt' column"):
        read_data_file(p)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 nope")
    with pytest.raises(RecipeError, match="not a readable Parquet file"):
        read_data_file(tmp_path / "bad.parquet")


def test_parquet_without_pyarrow_says_what_to_install(tmp_path: Path, monkeypatch) -> None:
    import sys

    from omni_train.data import read_data_file

    p = tmp_path / "d.parquet"
    p.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(RecipeError, match=re.escape("pip install 'omni-train[parquet]'")):
        read_data_file(p)


def test_prepare_edit_is_deterministic_and_names_palette_colours(tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    from omni_rewards.image import find_color
    from omni_train.data import read_data_file

    a = prepare("edit", tmp_path / "a", size=32, count=12, seed=5)
    b = prepare("edit", tmp_path / "b", size=32, count=12, seed=5)
    c = prepare("edit", tmp_path / "c", size=32, count=12, seed=6)
    assert a["train"].read_text() == b["train"].read_text()
    assert a["train"].read_text() != c["train"].read_text()
    rows = [json.loads(line) for line in a["train"].open()] + [
        json.loads(line) for line in a["test"].open()
    ]
    assert len(rows) == 12 and {r["edit"] for r in rows} <= {
        "background",
        "recolor",
        "add",
        "brighter",
    }
    for r in rows:
        src = np.asarray(Image.open(tmp_path / "a" / r["image"]))
        dst = np.asarray(Image.open(tmp_path / "a" / r["target"]))
        same = np.asarray(Image.open(tmp_path / "b" / r["image"]))
        assert src.shape == (32, 32, 3) and (src == same).all() and (src != dst).any()
        assert r["edit"] == "brighter" or find_color(r["prompt"]) is not None
    assert all(row.image is not None for row in read_data_file(a["train"]))


def test_shipped_tiny_edit_set_is_prepare_edit_output(tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    shipped = Path(__file__).resolve().parents[3] / "recipes" / "data" / "edit_tiny"
    prepare("edit", tmp_path, size=32, count=8, seed=0)
    for split in ("train", "test"):
        assert (shipped / f"{split}.jsonl").read_text() == (tmp_path / f"{split}.jsonl").read_text()
    for sub in ("images", "targets"):
        for f in sorted((tmp_path / sub).iterdir()):
            assert (
                np.asarray(Image.open(f)) == np.asarray(Image.open(shipped / sub / f.name))
            ).all()
    assert sum(f.stat().st_size for f in shipped.rglob("*") if f.is_file()) < 200_000


def test_prepare_mmk12_is_the_shapes_task_in_file_form(tmp_path: Path) -> None:
    from omni_train.tasks import read_omni_file, shapes_task

    paths = prepare("mmk12", tmp_path, count=16, seed=2)
    assert set(paths) == {"train", "val"}
    for split, n in (("train", 16), ("val", 4)):
        items = read_omni_file(paths[split])
        ref = shapes_task(split, n, 2)
        assert [i.answer for i in items] == [i.answer for i in ref]
        assert all((a.image == b.image).all() and a.prompt == b.prompt for a, b in zip(items, ref))


def test_prepare_cli_image_sets(tmp_path: Path, capsys) -> None:
    assert (
        main(["prepare", "edit", "--out", str(tmp_path / "e"), "--size", "16", "--count", "4"]) == 0
    )
    assert "train prompts" in capsys.readouterr().out
    assert len(list((tmp_path / "e" / "images").glob("*.png"))) == 4
    assert main(["prepare", "ocr", "--out", str(tmp_path / "o"), "--count", "3"]) == 2
    assert "apply to image datasets" in capsys.readouterr().err
    assert main(["prepare", "edit", "--out", str(tmp_path / "x"), "--size", "4"]) == 2
    assert "at least 16" in capsys.readouterr().err
