"""The repository stands alone: every link in its docs resolves, and the API names
docs/architecture.md promises exist.

- README.md, docs/*.md (and any other Markdown outside packages/): a relative link names a file
  or folder inside the repository.
- packages/*/README.md: PyPI shows these without the repository, so they link by absolute URL
  only; a link under the package's `[project.urls] Homepage` (`HOME/blob/main/PATH` or
  `HOME/tree/main/PATH`) names a PATH that exists here.
- docs/architecture.md, "Public API": the first name in backticks of each entry exists in its
  package (`sde.step` -> `omni_algos.sde.step`).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGE_READMES = sorted(REPO.glob("packages/*/README.md"))
REPO_DOCS = sorted(
    p
    for p in [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("docker/**/*.md")]
    if p.is_file()
)

INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HTML_LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")


def links(markdown: str) -> list[str]:
    """Every link target in a Markdown text, outside code blocks and inline code."""
    text = re.sub(r"^(```|~~~).*?^\1", "", markdown, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    found = [m.group(1) for m in INLINE_LINK.finditer(text)]
    found += [m.group(1) for m in REFERENCE_LINK.finditer(text)]
    found += [m.group(1) for m in HTML_LINK.finditer(text)]
    return found


def is_absolute(target: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*:", target) is not None  # https:, mailto:, ...


def broken_relative_links(doc: Path, root: Path = REPO) -> list[str]:
    """The relative links of `doc` that name nothing inside `root` (the repository)."""
    broken = []
    for target in links(doc.read_text()):
        if is_absolute(target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (doc.parent / path).resolve()
        if not resolved.is_relative_to(root.resolve()) or not resolved.exists():
            broken.append(target)
    return broken


def test_the_link_parser_sees_links_and_skips_code() -> None:
    text = (
        '[a](docs/x.md) ![img](pic.png) [b](https://e.org/y "title")\n'
        '[ref]: ../outside.md\n<a href="z.md">z</a>\n'
        "`[not](a-link.md)`\n```\n[not](either.md)\n```\n"
    )
    assert links(text) == ["docs/x.md", "pic.png", "https://e.org/y", "../outside.md", "z.md"]


@pytest.mark.parametrize("doc", REPO_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    assert broken_relative_links(doc) == []


def test_a_link_out_of_the_repository_is_caught(tmp_path: Path) -> None:
    """What README.md once had: a link to ../shared/DESIGN.md, a file beside the repository."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "DESIGN.md").write_text("# design\n")
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "architecture.md").write_text("# architecture\n")
    readme = repo / "README.md"
    readme.write_text(
        "[design](../shared/DESIGN.md) [arch](docs/architecture.md) [gone](docs/gone.md)\n"
    )
    assert broken_relative_links(readme, root=repo) == ["../shared/DESIGN.md", "docs/gone.md"]


def _homepage(readme: Path) -> str:
    project = tomllib.loads((readme.parent / "pyproject.toml").read_text())["project"]
    return project["urls"]["Homepage"].rstrip("/")


@pytest.mark.parametrize("readme", PACKAGE_READMES, ids=lambda p: p.parent.name)
def test_package_readmes_link_by_absolute_url_to_files_that_exist(readme: Path) -> None:
    home = _homepage(readme)
    targets = links(readme.read_text())
    relative = [t for t in targets if not is_absolute(t) and not t.startswith("#")]
    assert relative == [], f"{readme}: relative links break on PyPI: {relative}"
    for target in targets:
        if not target.startswith(home + "/"):
            continue
        match = re.match(r"(?:blob|tree)/main/([^#?]+)", target[len(home) + 1 :])
        assert match, f"{readme}: {target} is not {home}/blob/main/PATH or /tree/main/PATH"
        assert (REPO / match.group(1)).exists(), f"{readme}: {target} names no file here"


def test_every_package_names_the_same_homepage() -> None:
    homes = {_homepage(readme) for readme in PACKAGE_READMES}
    assert len(homes) == 1, homes


def _api_entries() -> list[tuple[str, str]]:
    """(package module, first backticked name) for each entry of the Public API section."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Public API", 1)[1].split("\n## ", 1)[0]
    entries = []
    for block in re.split(r"^### ", section, flags=re.M)[1:]:
        module = block.split()[0]
        # an entry is a "- " line and its indented continuation lines
        for item in re.split(r"^- ", block, flags=re.M)[1:]:
            first = re.search(r"`([^`]+)`", " ".join(item.split()))
            name = re.split(r"[(\s]", first.group(1), maxsplit=1)[0] if first else ""
            if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):  # skips CLI lines
                entries.append((module, name.removeprefix(module + ".")))
    return entries


@pytest.mark.parametrize("module, name", _api_entries())
def test_architecture_api_names_exist(module: str, name: str) -> None:
    obj = importlib.import_module(module)
    for i, part in enumerate(name.split(".")):
        if not hasattr(obj, part):  # a submodule not imported by the package itself
            obj = importlib.import_module(".".join([module, *name.split(".")[: i + 1]]))
        else:
            obj = getattr(obj, part)
    assert obj is not None


def test_architecture_lists_an_entry_for_each_package() -> None:
    modules = {module for module, _ in _api_entries()}
    assert modules == {
        "omni_algos",
        "diffusion_rollout",
        "omni_rewards",
        "omni_adapters",
        "omni_train",
    }
    assert len(_api_entries()) >= 20


def _table_after(doc: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table under ``heading``, header row first."""
    lines = doc.splitlines()
    i = lines.index(heading) + 1
    while not lines[i].startswith("|"):
        i += 1
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        rows.append([c.strip() for c in lines[i].strip().strip("|").split(" | ")])
        i += 1
    return [rows[0], *rows[2:]]  # without the |---| line


def test_models_support_matrix_has_a_row_per_tiny_family() -> None:
    """docs/models.md's support matrix: one row per family `omni_adapters.tiny` builds, each
    with as many cells as the header (a later table once overwrote its rows)."""
    from omni_adapters import tiny

    header, *rows = _table_after((REPO / "docs" / "models.md").read_text(), "## Support matrix")
    assert header[0] == "family" and len(header) == 8
    assert all(len(r) == len(header) for r in rows), [r[0] for r in rows if len(r) != 8]
    named = {r[0].split("`")[1] for r in rows}
    assert named == set(tiny.families())
