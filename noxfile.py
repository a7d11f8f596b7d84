"""Developer sessions for the omni-rl workspace.

    uv run nox -s tests          every package's tests (and tests/, the repository's checks) in
                                 the workspace environment, then a table of each one's time
    uv run nox -s dockerfiles    docker/*: hadolint, and COPY/ADD sources exist in the repository
    uv run nox -s tests-omni-algos   one package's tests
    uv run nox -s lint           ruff check + ruff format --check
    uv run nox -s contracts      docs/architecture.md's import rules (import-linter, root pyproject)
    uv run nox -s standalone     each package's wheel alone in a venv, its non-slow tests there
    uv run nox -s tests-verl     the verl backend's tests in the lock's verl environment
    uv run nox -s tests-vllm-omni  the vllm-omni backend's tests in the lock's vllm-omni environment
    uv run nox -s bench          the benchmark scripts (print measured ratios)
    uv run nox -s soak           both servers under 500 clients + malformed traffic (prints)

`tests`, `lint` and `contracts` run in the environment nox itself runs in (the workspace venv
that `uv run` syncs), so they install nothing. `standalone` builds wheels and makes one venv per
package with uv, which is what a user who runs `pip install <package>` gets.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nox
from nox.command import CommandFailed

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "contracts", "dockerfiles", "tests"]
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


# Standalone venvs whose tests start many Python processes (CLI runs, servers, Ray workers):
# `_precompile` pays for itself there. Measured in CI with PYTHONDONTWRITEBYTECODE set:
# omni-train's standalone tests took 636 s against 418 s in the precompiled workspace, and
# `import torch, diffusers, transformers` 11.7 s against 5.3 s; compiling the venv takes 24 s.
# The other packages' tests run in one pytest process: compiling would cost what it saves.
PRECOMPILE_STANDALONE = {"omni-train"}

# The repository-level checks (tests/: links in the docs, the Dockerfiles), a row of `tests`.
REPOSITORY = "repository"
DOCKERFILE_TESTS = "tests/test_dockerfiles.py"


def _test_env() -> dict[str, str]:
    """Environment for test runs: a throwaway HOME (onnxruntime, matplotlib and the tiny-model
    cache write there) and no hub access, so nothing can try to download weights."""
    home = os.environ.get("OMNI_TEST_HOME") or tempfile.mkdtemp(prefix="omni-test-home-")
    env = {"HOME": home, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg"}
    # The root conftest.py's hypothesis profile: derandomized, no example database, so a run
    # never replays a failure stored by an earlier one and every run checks the same examples.
    env["HYPOTHESIS_PROFILE"] = os.environ.get("HYPOTHESIS_PROFILE", "ci")
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
    """docs/architecture.md's import rules, as import-linter contracts in the root pyproject."""
    lint_imports = Path(sys.executable).parent / "lint-imports"
    session.run(str(lint_imports), "--no-cache", external=True)


def _precompile(session: nox.Session, python: str = sys.executable) -> None:
    """Write the .pyc files of ``python``'s installed packages (the workspace environment's by
    default) once.

    A test run starts many Python processes (pytest, CLIs, servers, Ray workers). Where Python
    does not write bytecode at import (PYTHONDONTWRITEBYTECODE, a read-only site-packages) each
    of them compiles torch, transformers and diffusers from source again: ~8 CPU-seconds per
    process here. compileall skips files whose .pyc is current, so a second run costs ~2 s.
    Exit code 1 means a few files did not compile (templates, other Python versions' code):
    Python never imports those, so it is not an error."""
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    session.run(
        python,
        "-m",
        "compileall",
        "-q",
        "-j",
        "0",
        purelib,
        success_codes=[0, 1],
        external=True,
        silent=True,
    )


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_timed(session: nox.Session, packages: list[str], run) -> None:
    """``run(package)`` for each package, all of them even when one fails; then a table of
    each package's wall time, CPU time (user + sys of its processes: what a busy machine does
    not inflate) and result; the session fails at the end if any package did."""
    rows: list[tuple[str, float, float, str]] = []
    for package in packages:
        wall, cpu = time.monotonic(), _children_cpu_s()
        try:
            run(package)
            result = "passed"
        except CommandFailed:
            result = "FAILED"
        rows.append((package, time.monotonic() - wall, _children_cpu_s() - cpu, result))
    print(timing_table(rows), flush=True)
    failed = [name for name, *_, result in rows if result != "passed"]
    if failed:
        session.error(f"tests failed in {', '.join(failed)}")


def timing_table(rows: list[tuple[str, float, float, str]]) -> str:
    """A plain-text table: package, wall s, CPU s, result, and a total row."""
    lines = [f"{'package':<20} {'wall s':>8} {'cpu s':>8}  result"]
    lines += [f"{name:<20} {wall:>8.1f} {cpu:>8.1f}  {result}" for name, wall, cpu, result in rows]
    total_wall, total_cpu = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines.append(f"{'total':<20} {total_wall:>8.1f} {total_cpu:>8.1f}")
    return "\n".join(lines)


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Every package's tests, one pytest run per package (as their standalone runs do), and the
    repository's checks in tests/; then a table of each one's time. A failure does not stop the
    rest."""
    _precompile(session)

    def run(name: str) -> None:
        target = "tests" if name == REPOSITORY else ""
        _pytest(session, sys.executable, name, *session.posargs, target=target)

    _run_timed(session, [*PACKAGES, REPOSITORY], run)


@nox.session(venv_backend="none")
def dockerfiles(session: nox.Session) -> None:
    """docker/*.Dockerfile: hadolint, and every COPY/ADD source is a file of the repository
    (tests/test_dockerfiles.py; no Docker engine needed)."""
    _pytest(session, sys.executable, REPOSITORY, *session.posargs, target=DOCKERFILE_TESTS)


for _package in PACKAGES:

    def _one_package(session: nox.Session, package: str = _package) -> None:
        _precompile(session)
        _pytest(session, sys.executable, package, *session.posargs)

    _one_package.__doc__ = f"{_package}'s tests in the workspace environment."
    nox.session(name=f"tests-{_package}", venv_backend="none")(_one_package)


@nox.session(venv_backend="none")
def standalone(session: nox.Session) -> None:
    """Build each package's wheel, install it alone (with its declared dependencies and the
    wheels of the omni-* packages it needs) into a fresh venv, and run its tests there but the
    `slow` ones (`tests` runs those on the same code): 708 s of omni-train's 923 s standalone
    before, 300 s after, on a 2-core machine where the whole CI took 2262 s. The Ray pools
    beyond sd3's actor pool and the async run on Ray are `slow` too (about 100 s of those 300)."""
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

    def install_and_test(package: str) -> None:
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
        if package in PRECOMPILE_STANDALONE:
            _precompile(session, python)
        # Run from a folder outside the repo's src/ trees: imports resolve to the wheel. The
        # `slow` tests (long training runs, Ray clusters) ran on the same code in `tests`; here
        # every other test checks that the wheel works with its declared dependencies alone.
        _pytest(session, python, package, "-m", "not slow")

    _run_timed(session, packages, install_and_test)


def _fork_env(session: nox.Session, extra: str) -> Path:
    """A venv (.nox/<extra>-env) synced from uv.lock with the root `extra`: the lock's fork for
    a backend that cannot share the workspace's environment."""
    env_dir = ROOT / ".nox" / f"{extra}-env"
    session.run(
        "uv",
        "sync",
        "--locked",
        "--quiet",
        "--extra",
        extra,
        env={"UV_PROJECT_ENVIRONMENT": str(env_dir)},
        external=True,
    )
    return env_dir


@nox.session(name="tests-verl", venv_backend="none")
def tests_verl(session: nox.Session) -> None:
    """The verl hand-off's tests, in verl's own environment: verl pins transformers < 5.11, so
    it gets the lock's `verl` fork in a separate venv instead of the workspace's."""
    env_dir = _fork_env(session, "verl")
    test_file = "packages/omni-train/tests/test_verl_backend.py"
    _pytest(
        session, str(env_dir / "bin" / "python"), "omni-train", *session.posargs, target=test_file
    )


@nox.session(name="tests-vllm-omni", venv_backend="none")
def tests_vllm_omni(session: nox.Session) -> None:
    """The vllm-omni backend's contract tests against vllm-omni's own classes, and omni-train
    runs on that backend, local and on Ray (`tests/test_vllm_omni_rollout.py`), in the lock's
    `vllm-omni` fork (vllm-omni 0.30 + vLLM 0.30 pin transformers, diffusers and torch apart
    from the workspace)."""
    # diffusion-rollout's own `vllm-omni` extra, not the root's: synced through the root, the
    # other members' torch pins win (torch 2.15 beside vLLM 0.30's CUDA libraries: torch does
    # not import). The tests also build the tiny SD3 with omni-adapters, whose dependencies
    # (diffusers, transformers, peft) this fork already holds at vllm-omni's versions.
    env_dir = ROOT / ".nox" / "vllm-omni-env"
    session.run(
        "uv",
        "sync",
        "--locked",
        "--quiet",
        "--package",
        "diffusion-rollout",
        "--extra",
        "vllm-omni",
        "--extra",
        "test",
        env={"UV_PROJECT_ENVIRONMENT": str(env_dir)},
        external=True,
    )
    # omni-train's run on the vllm-omni rollout needs the other members too: their own
    # dependencies are in this fork already but matplotlib (that test draws no reward curve)
    members = ("omni-adapters", "omni-algos", "omni-rewards", "omni-train")
    editable = [arg for m in members for arg in ("-e", str(ROOT / "packages" / m))]
    python = str(env_dir / "bin" / "python")
    session.run(
        "uv", "pip", "install", "--quiet", "--python", python, "--no-deps", *editable, external=True
    )
    # and Ray, for the run under `trainer.backend: ray`: the lock's version; its own dependencies
    # are in this fork already, so nothing else changes
    ray = f"ray=={_locked_version('ray')}"
    session.run("uv", "pip", "install", "--quiet", "--python", python, ray, external=True)
    for package, test_file in (
        ("diffusion-rollout", "packages/diffusion-rollout/tests/test_vllm_backend.py"),
        ("omni-train", "packages/omni-train/tests/test_vllm_omni_rollout.py"),
    ):
        _pytest(session, python, package, *session.posargs, target=test_file)


def _locked_version(name: str) -> str:
    """The version of ``name`` in uv.lock (one version for every fork). A pattern, not a TOML
    parser: tomllib is not in Python 3.10, which the workspace admits."""
    entry = rf'\[\[package\]\]\nname = "{re.escape(name)}"\nversion = "([^"]+)"'
    (version,) = set(re.findall(entry, (ROOT / "uv.lock").read_text()))
    return version


def _wheel(dist: Path, package: str) -> Path:
    (wheel,) = dist.glob(f"{package.replace('-', '_')}-*.whl")
    return wheel


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Run every benchmark script but the soak; each prints ratios measured side by side."""
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        if script.name != "soak.py":
            session.run(sys.executable, str(script), *session.posargs, external=True)


@nox.session(venv_backend="none")
def soak(session: nox.Session) -> None:
    """Both servers under 500 concurrent clients and a burst of malformed traffic (loopback);
    prints requests answered, errors by kind, peak memory and p99 latency. Options after --,
    e.g. `nox -s soak -- --clients 100 --only reward`."""
    script = ROOT / "benchmarks" / "soak.py"
    # HOME stays: the tiny SD3 the soak serves is built once into ~/.cache/omni-rl-soak
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    session.run(sys.executable, str(script), *session.posargs, env=offline, external=True)
