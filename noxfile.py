"""Developer sessions for the omni-rl workspace.

    uv run nox -s tests          every package's tests, in the workspace environment
    uv run nox -s tests-omni-algos   one package's tests
    uv run nox -s lint           ruff check + ruff format --check
    uv run nox -s contracts      DESIGN.md's import rules (import-linter, root pyproject)
    uv run nox -s standalone     each package's wheel alone in a fresh venv, its tests there
    uv run nox -s tests-verl     the verl backend's tests in the lock's verl environment
    uv run nox -s bench          the benchmark scripts (print measured ratios)

`tests`, `lint` and `contracts` run in the environment nox itself runs in (the workspace venv
that `uv run` syncs), so they install nothing. `standalone` builds wheels and makes one venv per
package with uv, which is what a user who runs `pip install <package>` gets.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "contracts", "tests"]
nox.options.default_venv_backend = "uv"

# Package folder -> (omni-* packages it depends on, extras its own tests need).
PACKAGES: dict[str, tuple[list[str], list[str]]] = {
    "omni-algos": ([], ["test"]),
    "omni-rewards": (
        [],
        [
            "ocr",
            "clip",
            "open-clip",
            "clap",
            "imagebind",
            "latent",
            "dina-lrm",
            "math",
            "server",
            "test",
        ],
    ),
    "omni-adapters": ([], ["test"]),
    "diffusion-rollout": (["omni-algos"], ["server", "test"]),
    "omni-train": (
        ["omni-algos", "omni-rewards", "omni-adapters", "diffusion-rollout"],
        ["tensorboard", "ray", "wandb", "parquet", "test"],
    ),
}


def _test_env() -> dict[str, str]:
    """Environment for test runs: a throwaway HOME (onnxruntime, matplotlib and the tiny-model
    cache write there) and no hub access, so nothing can try to download weights."""
    home = os.environ.get("OMNI_TEST_HOME") or tempfile.mkdtemp(prefix="omni-test-home-")
    env = {"HOME": home, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg"}
    # uv's cache stays where it was, so a changed HOME does not mean a fresh download.
    if "UV_CACHE_DIR" not in os.environ and shutil.which("uv"):
        env["UV_CACHE_DIR"] = str(Path(os.environ.get("HOME", "~")).expanduser() / ".cache" / "uv")
    return env


def _pytest(session: nox.Session, python: str, package: str, *args: str, target: str = "") -> None:
    session.run(
        python,
        "-m",
        "pytest",
        target or f"packages/{package}/tests",
        "-q",
        "-p",
        "no:cacheprovider",
        *args,
        env=_test_env(),
        external=True,
    )


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole workspace."""
    session.run(sys.executable, "-m", "ruff", "check", ".", external=True)
    session.run(sys.executable, "-m", "ruff", "format", "--check", ".", external=True)


@nox.session(venv_backend="none")
def contracts(session: nox.Session) -> None:
    """The import rules of DESIGN.md, as import-linter contracts in the root pyproject."""
    lint_imports = Path(sys.executable).parent / "lint-imports"
    session.run(str(lint_imports), "--no-cache", external=True)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Every package's tests, one pytest run per package (as their standalone runs do)."""
    for package in PACKAGES:
        _pytest(session, sys.executable, package, *session.posargs)


for _package in PACKAGES:

    def _one_package(session: nox.Session, package: str = _package) -> None:
        _pytest(session, sys.executable, package, *session.posargs)

    _one_package.__doc__ = f"{_package}'s tests in the workspace environment."
    nox.session(name=f"tests-{_package}", venv_backend="none")(_one_package)


@nox.session(venv_backend="none")
def standalone(session: nox.Session) -> None:
    """Build each package's wheel, install it alone (with its declared dependencies and the
    wheels of the omni-* packages it needs) into a fresh venv, and run its tests there."""
    packages = session.posargs or list(PACKAGES)
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in PACKAGES:
        session.run(
            "uv",
            "build",
            "--package",
            package,
            "--wheel",
            "--out-dir",
            str(dist),
            "-q",
            external=True,
        )
    for package in packages:
        deps, extras = PACKAGES[package]
        venv = ROOT / ".nox" / f"standalone-{package}"
        shutil.rmtree(venv, ignore_errors=True)
        session.run("uv", "venv", "-q", "--python", sys.executable, str(venv), external=True)
        python = str(venv / "bin" / "python")
        wheels = [_wheel(dist, dep) for dep in deps]
        own = f"{package} @ {_wheel(dist, package).as_uri()}"
        if extras:
            own = f"{package}[{','.join(extras)}] @ {_wheel(dist, package).as_uri()}"
        session.run(
            "uv", "pip", "install", "-q", "--python", python, own, *map(str, wheels), external=True
        )
        # Run from a folder outside the repo's src/ trees: imports resolve to the wheel.
        _pytest(session, python, package)


@nox.session(name="tests-verl", venv_backend="none")
def tests_verl(session: nox.Session) -> None:
    """The verl hand-off's registry tests, in verl's own environment: verl pins transformers
    < 5.11, so it gets the lock's `verl` fork in a separate venv instead of the workspace's."""
    env_dir = ROOT / ".nox" / "verl-env"
    session.run(
        "uv",
        "sync",
        "--locked",
        "--quiet",
        "--extra",
        "verl",
        env={"UV_PROJECT_ENVIRONMENT": str(env_dir)},
        external=True,
    )
    test_file = "packages/omni-train/tests/test_verl_backend.py"
    _pytest(
        session, str(env_dir / "bin" / "python"), "omni-train", *session.posargs, target=test_file
    )


def _wheel(dist: Path, package: str) -> Path:
    (wheel,) = dist.glob(f"{package.replace('-', '_')}-*.whl")
    return wheel


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Run every benchmark script; each prints ratios measured side by side in one run."""
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        session.run(sys.executable, str(script), *session.posargs, external=True)
