"""The HTTP hardening that diffusion-rollout's and omni-rewards' servers share stays one design.

The two packages import nothing of each other (each is usable alone), so each carries its own
copy of the guarded uvicorn protocol (`serving.py`), the strict JSON parser (`safe_json.py`),
the connection limits and the CLI helpers. Copies drift: `_one_line` had, and the rewards CLI cut
the closing quote off its messages. This test holds the copies equal, statement for statement
(docstrings and comments may differ; each package's own module name is read as the same name), so
a fix made in one fails here until it is made in the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
ROLLOUT = ("diffusion-rollout", "diffusion_rollout")
REWARDS = ("omni-rewards", "omni_rewards")

#: module -> the top-level names both copies define identically (None: the whole module)
SHARED: dict[str, tuple[str, ...] | None] = {
    "serving": None,
    "safe_json": None,
    "limits": ("_limit", "_check_positive", "HTTPLimits"),
    "cli": ("_one_line", "_Parser", "_add_limit_flags"),
    "server": ("_CLOSE",),
}


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return body[1:] if is_doc and isinstance(first.value.value, str) else body


def _name(node: ast.stmt) -> str | None:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name
    target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
    return target.id if isinstance(target, ast.Name) else None


class _StripDocstrings(ast.NodeTransformer):
    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            node.body = _without_docstring(node.body) or [ast.Pass()]
        return node


def top_level(package: tuple[str, str], module: str) -> dict[str, str]:
    folder, import_name = package
    return statements(PACKAGES / folder / "src" / import_name / f"{module}.py", import_name)


def statements(path: Path, import_name: str) -> dict[str, str]:
    """Each top-level statement of the module at ``path`` as text without docstrings, the
    package's own module name replaced by ``PKG``; keyed by the name it defines (or its index)."""
    tree = ast.parse(path.read_text())
    out = {}
    for i, node in enumerate(_without_docstring(tree.body)):
        text = ast.unparse(_StripDocstrings().visit(node)).replace(import_name, "PKG")
        out[_name(node) or f"statement {i}"] = text
    return out


@pytest.mark.parametrize("module", sorted(SHARED))
def test_the_two_servers_share_one_copy(module: str) -> None:
    rollout, rewards = top_level(ROLLOUT, module), top_level(REWARDS, module)
    names = SHARED[module]
    if names is None:
        assert list(rollout) == list(rewards), f"{module}.py: the statements differ in order"
        names = tuple(rollout)
    for name in names:
        assert name in rollout and name in rewards, f"{module}.{name}: missing in one copy"
        assert rollout[name] == rewards[name], (
            f"{module}.{name} differs between diffusion_rollout and omni_rewards: change both"
        )


def test_a_difference_is_found(tmp_path: Path) -> None:
    """The comparison sees a changed statement and ignores a changed docstring or comment, and
    the package's own name."""
    base = 'import pkg_a.x\n\n\ndef f(x):\n    """Doc."""\n    return x + 1  # one\n'
    other = tmp_path / "other.py"

    def same(text: str) -> bool:
        (tmp_path / "a.py").write_text(base)
        other.write_text(text)
        return statements(tmp_path / "a.py", "pkg_a") == statements(other, "pkg_b")

    assert same(base.replace("pkg_a", "pkg_b"))
    assert same(base.replace("pkg_a", "pkg_b").replace("Doc.", "Other.").replace("one", "two"))
    assert not same(base.replace("pkg_a", "pkg_b").replace("x + 1", "x + 2"))
    assert not same(base.replace("pkg_a", "pkg_c"))
