"""Shared test fixtures: tiny models built once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # release_fixtures

import omni_adapters


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """``tiny_path(family)`` builds the tiny model once per session and returns its folder."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            root = tmp_path_factory.mktemp(f"tiny_{family}") / family
            omni_adapters.tiny.build(family, root, seed=0)
            cache[family] = root
        return cache[family]

    return get
