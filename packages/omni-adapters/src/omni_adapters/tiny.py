"""Architecture-faithful tiny random models, saved to disk.

``tiny.build(family, path, seed=0)`` builds the family's real classes (diffusers /
transformers) with tiny configs, text encoders and tokenizers made in memory, and saves
everything with ``save_pretrained`` so it loads back through the same
:func:`omni_adapters.from_pretrained` path real weights use. Nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .base import FAMILY_MODULES, load_family_modules, quiet_progress

__all__ = ["BUILDERS", "build", "families", "register_tiny"]

#: family -> builder(path, seed) writing a model folder
BUILDERS: dict[str, Callable[[Path, int], None]] = {}


def register_tiny(
    family: str,
) -> Callable[[Callable[[Path, int], None]], Callable[[Path, int], None]]:
    """Decorator: register ``fn(path: Path, seed: int) -> None`` as the tiny builder of ``family``."""

    def decorate(fn: Callable[[Path, int], None]) -> Callable[[Path, int], None]:
        BUILDERS[family] = fn
        return fn

    return decorate


def families() -> list[str]:
    """Families with a tiny builder."""
    load_family_modules()
    return sorted(BUILDERS)


def build(family: str, path: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build the tiny ``family`` model into ``path`` (created; must be empty or absent).

    Same family + seed gives the same weights bit for bit. Returns the path."""
    if family not in FAMILY_MODULES:
        raise ValueError(f"family: unknown family {family!r}; known: {sorted(FAMILY_MODULES)}")
    load_family_modules([family])
    if family not in BUILDERS:
        raise ValueError(f"family: {family!r} has no tiny builder yet")
    root = Path(path)
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"path: {root} exists and is not empty")
    root.mkdir(parents=True, exist_ok=True)
    with quiet_progress():
        BUILDERS[family](root, int(seed))
    return root
