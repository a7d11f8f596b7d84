"""Architecture-faithful tiny random models, saved to disk.

``tiny.build(family, path, seed=0)`` builds the family's real classes (diffusers /
transformers) with tiny configs, text encoders and tokenizers made in memory, and saves
everything with ``save_pretrained`` so it loads back through the same
:func:`omni_adapters.from_pretrained` path real weights use. Nothing is downloaded.

Each build also writes ``tiny_build.json`` (family, seed, the builder's revision), so a cached
tiny model can be checked against what the current code would build (:func:`build_stamp`):
a builder whose weights change bumps its ``revision``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from .base import FAMILY_MODULES, load_family_modules, quiet_progress

__all__ = ["BUILDERS", "STAMP_FILE", "build", "build_stamp", "families", "register_tiny"]

#: family -> builder(path, seed) writing a model folder
BUILDERS: dict[str, Callable[[Path, int], None]] = {}
#: family -> revision of its builder (bumped when the weights it writes change)
REVISIONS: dict[str, int] = {}
#: the file each build writes next to the model: {"family", "seed", "revision"}
STAMP_FILE = "tiny_build.json"


def register_tiny(
    family: str, revision: int = 1
) -> Callable[[Callable[[Path, int], None]], Callable[[Path, int], None]]:
    """Decorator: register ``fn(path: Path, seed: int) -> None`` as the tiny builder of
    ``family``; ``revision`` changes whenever the model it writes changes."""

    def decorate(fn: Callable[[Path, int], None]) -> Callable[[Path, int], None]:
        BUILDERS[family] = fn
        REVISIONS[family] = int(revision)
        return fn

    return decorate


def build_stamp(family: str, seed: int = 0) -> dict[str, object]:
    """What ``tiny_build.json`` holds for a build of ``family`` with ``seed`` by this code."""
    if family not in FAMILY_MODULES:
        raise ValueError(f"family: unknown family {family!r}; known: {sorted(FAMILY_MODULES)}")
    load_family_modules([family])
    if family not in BUILDERS:
        raise ValueError(f"family: {family!r} has no tiny builder")
    return {"family": family, "seed": int(seed), "revision": REVISIONS[family]}


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
    stamp = build_stamp(family, seed)
    (root / STAMP_FILE).write_text(json.dumps(stamp, sort_keys=True) + "\n")
    return root
