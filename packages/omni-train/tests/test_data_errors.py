"""Data files that are wrong in every way a file can be: one RecipeError each, with the file
and the line (or row), never a traceback from deep inside a step."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from omni_train.data import MAX_PROMPT_CHARS, PromptData, read_data_file, read_prompt_file
from omni_train.recipe import RecipeError
from omni_train.tasks import read_omni_file


def _raises(fn, path, *words):
    with pytest.raises(RecipeError) as info:
        fn(path)
    msg = str(info.value)
    assert "\n" not in msg, msg
    for word in (str(path), *words):
        assert word in msg, (word, msg)
    return msg


def _png(path: Path, size=(6, 4), mode="RGB") -> Path:
    from PIL import Image

    Image.new(mode, size).save(path)
    return path


@pytest.mark.parametrize("reader", [read_prompt_file, read_omni_file])
def test_encoding_problems_name_file_and_line(tmp_path: Path, reader) -> None:
    row = json.dumps({"prompt": "ok", "answer": "A"}).encode()
    p = tmp_path / "d.jsonl"
    p.write_bytes(row + b"\n" + row + b"\n" + b'{"prompt": "caf\xe9", "answer": "A"}\n')
    _raises(reader, p, "line 3", "not UTF-8", "0xe9")
    p.write_bytes("\n".join([row.decode()] * 2).encode("utf-16"))
    _raises(reader, p, "UTF-16")
    p.write_bytes(row + b"\n" + b'{"prompt": "bad \\ud800 half", "answer": "A"}\n')
    _raises(reader, p, "line 2", "not valid Unicode")
    p.write_bytes(row + b"\n" + b'{"prompt": "x", "answer": "A", "n": ' + b"9" * 5000 + b"}\n")
    _raises(reader, p, "line 2", "not valid JSON")
    p.write_bytes(b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    _raises(reader, p, "line 1", "not valid JSON")
    p.write_bytes(b"\xef\xbb\xbf" + row + b"\r\n" + row + b"\r\n")  # BOM and CRLF are fine
    assert len(reader(p)) == 2


def test_oversize_prompts_name_file_and_line(tmp_path: Path) -> None:
    long = "a photo of a cat " * (MAX_PROMPT_CHARS // 10)
    p = tmp_path / "d.txt"
    p.write_text(f"fine\n\n{long}\n")
    _raises(read_prompt_file, p, "line 3", "characters", str(MAX_PROMPT_CHARS))
    q = tmp_path / "d.jsonl"
    q.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": long}) + "\n")
    _raises(read_prompt_file, q, "line 2", "more than")
    o = tmp_path / "o.jsonl"
    o.write_text(json.dumps({"prompt": long, "answer": "A"}) + "\n")
    _raises(read_omni_file, o, "line 1", "more than")
    with pytest.raises(RecipeError, match=re.escape("data.prompts[1]: 'prompt' has")):
        from omni_train.recipe import DataConfig

        PromptData.from_config(DataConfig(prompts=["ok", long]), seed=0)


def test_parquet_oversize_prompt_names_the_row(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["ok", "x" * (MAX_PROMPT_CHARS + 1)]}), p)
    _raises(read_data_file, p, "row 1 (0-based)", "more than")


@pytest.mark.parametrize("reader", [read_prompt_file, read_omni_file])
def test_wrong_path_types(tmp_path: Path, reader) -> None:
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    _raises(reader, folder, "is a directory, not a file")
    _raises(reader, tmp_path / "missing.jsonl", "does not exist")
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "pipe.jsonl"
        os.mkfifo(fifo)
        _raises(reader, fifo, "not a regular file")  # and no hang reading it
    (tmp_path / "img_dir").mkdir()
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "x", "answer": "A", "image": "img_dir"}) + "\n")
    _raises(reader, p, "line 1", "image", "is a directory")
    p.write_text(json.dumps({"prompt": "x", "answer": "A", "image": 7}) + "\n")
    _raises(reader, p, "line 1", "'image'")


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> Path:
    """A 30 kB PNG that declares 15000 x 15000 = 225 M pixels."""
    path = _png(tmp_path_factory.mktemp("bomb") / "bomb.png", size=(15_000, 15_000), mode="1")
    assert path.stat().st_size < 1_000_000
    return path


@pytest.mark.parametrize("reader", [read_prompt_file, read_omni_file])
def test_decompression_bomb_image_names_the_line(tmp_path: Path, reader, bomb: Path) -> None:
    from PIL import Image

    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "x", "answer": "A", "image": str(bomb)}) + "\n")
    msg = _raises(reader, p, "line 1", "bomb.png")
    assert "decompression bomb" in msg.lower() or str(Image.MAX_IMAGE_PIXELS) in msg
