"""`omni-rewards --version`, and one readable line (not a traceback) when an extra is missing."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest
from PIL import Image

import omni_rewards
from omni_rewards.cli import main


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    version = metadata.version("omni-rewards")
    assert capsys.readouterr().out.strip() == f"omni-rewards {version}"
    assert omni_rewards.__version__ == version  # the module's constant follows the pyproject


def test_serve_without_the_server_extra_is_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` now fails as if absent
    assert main(["serve", "brightness", "--port", "9"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("omni-rewards: error:")
    assert "'uvicorn'" in err and "pip install 'omni-rewards[server]'" in err


def test_score_without_the_ocr_extra_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(image)
    monkeypatch.setitem(sys.modules, "rapidocr", None)
    assert main(["score", "ocr", str(image), "--prompt", "OPEN"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'omni-rewards[ocr]'" in err


def test_console_script_prints_no_traceback() -> None:
    """The same through a real process: stderr is the one line, the exit status 1."""
    code = (
        "import sys; sys.modules['uvicorn'] = None; "
        "from omni_rewards.cli import main; sys.exit(main(['serve', 'brightness']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "omni-rewards: error: omni-rewards serve needs the python package 'uvicorn', which is not "
        "installed: pip install 'omni-rewards[server]'"
    ]
