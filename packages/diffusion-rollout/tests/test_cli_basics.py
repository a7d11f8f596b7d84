"""`diffusion-rollout --version`, and one readable line when the server extra is missing."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from diffusion_rollout.cli import SERVER_EXTRA_MODULES, main


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"diffusion-rollout {metadata.version('diffusion-rollout')}"
    )


@pytest.mark.parametrize("missing", ["uvicorn", "starlette"])
def test_serve_without_the_server_extra_is_one_line(missing, monkeypatch, capsys) -> None:
    # the import now fails as if absent, its submodules too (an earlier test may have loaded them)
    for name in [n for n in sys.modules if n == missing or n.startswith(missing + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, missing, None)
    monkeypatch.delitem(sys.modules, "diffusion_rollout.server", raising=False)
    loaded = []
    code = main(
        ["serve", "--model", "m", "--port", "9"],
        denoiser_factory=lambda path, device: loaded.append(path),
    )
    assert code == 1
    assert loaded == []  # it stops before loading a model
    err = capsys.readouterr().err
    assert err == (
        f"diffusion-rollout: error: serve needs the python package {missing!r}, which is not "
        "installed: pip install 'diffusion-rollout[server]'\n"
    )


def test_server_extra_modules_match_the_pyproject() -> None:
    """SERVER_EXTRA_MODULES are the import names of exactly the `server` extra's packages."""
    server = {
        Requirement(line).name.lower()
        for line in metadata.requires("diffusion-rollout") or []
        if Requirement(line).marker is not None
        and Requirement(line).marker.evaluate({"extra": "server"})
    }
    assert server, "diffusion-rollout declares no server extra"
    distributions = metadata.packages_distributions()
    for module in SERVER_EXTRA_MODULES:
        assert {d.lower() for d in distributions.get(module, [])} & server, module
    provided = {d.lower() for module in SERVER_EXTRA_MODULES for d in distributions.get(module, [])}
    assert server <= provided
