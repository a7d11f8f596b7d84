"""noxfile.py: every package with tests has a row in `tests` and a standalone venv (PACKAGES),
so a package added to the workspace cannot have its tests silently left out of CI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def noxfile():
    pytest.importorskip("nox")
    spec = importlib.util.spec_from_file_location("omni_noxfile", REPO / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_workspace_package_with_tests_has_a_row(noxfile):
    assert 'members = ["packages/*"]' in (REPO / "pyproject.toml").read_text()
    packages = {
        path.name
        for path in (REPO / "packages").iterdir()
        if (path / "tests").is_dir() and (path / "pyproject.toml").is_file()
    }
    assert packages == set(noxfile.PACKAGES)
    # Each one's omni-* dependencies are packages of the workspace too.
    for deps, _extras in noxfile.PACKAGES.values():
        assert set(deps) <= packages
