"""What ``omni-train --version`` prints: this package's version, and the versions of the
packages a bug report needs (the other omni-* packages and torch), read from the installed
distributions' metadata without importing them."""

from __future__ import annotations

import platform
from importlib import metadata

__all__ = ["version_text"]

REPORTED = ("omni-algos", "omni-rewards", "omni-adapters", "diffusion-rollout", "torch")


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def version_text() -> str:
    """``omni-train 0.1.0 (omni-algos 0.1.0, ..., torch 2.9.1, python 3.11.7)``."""
    others = ", ".join(f"{name} {_version(name)}" for name in REPORTED)
    return f"omni-train {_version('omni-train')} ({others}, python {platform.python_version()})"
