from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    pytest.importorskip("rapidocr")
    text = README.read_text()
    assert "pip install omni-rewards[ocr]" in text
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)
    assert len([line for line in code.splitlines() if line.strip()]) <= 10
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, str(README), "exec"), {})
    assert buf.getvalue().startswith("[1. 0.]"), buf.getvalue()
