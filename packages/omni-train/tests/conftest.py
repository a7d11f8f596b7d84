"""Shared helpers for omni-train tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

PROMPTS = ["a red square", "a blue circle", "a green field", "a yellow sun"]


def minimal_recipe_dict(tmp_path: Path, model_path: Path | None = None) -> dict:
    """A small valid recipe (tiny SD3 built under tmp_path on first use)."""
    return {
        "experiment": "test",
        "model": {"path": str(model_path or tmp_path / "model"), "tiny": "sd3"},
        "data": {"prompts": list(PROMPTS), "prompts_per_step": 2},
        "rollout": {
            "n": 4,
            "height": 32,
            "width": 32,
            "num_steps": 4,
            "sde_window_size": 2,
            "sde_window_range": [0, 2],
        },
        "reward": {"name": "color_match"},
        "trainer": {"steps": 2, "output_dir": str(tmp_path / "run"), "progress": False},
    }


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory) -> Path:
    """One tiny SD3 model folder shared by the session's tests."""
    from omni_adapters import tiny

    path = tmp_path_factory.mktemp("tiny") / "sd3"
    tiny.build("sd3", path, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_thinker(tmp_path_factory) -> Path:
    """One tiny Qwen3-Omni thinker folder shared by the session's tests."""
    from omni_adapters import tiny

    path = tmp_path_factory.mktemp("tiny") / "thinker"
    tiny.build("qwen3_omni_thinker", path, seed=0)
    return path


@pytest.fixture
def recipe_dict(tmp_path: Path):
    """A factory: `recipe_dict()` returns a fresh minimal recipe dict."""
    return lambda: minimal_recipe_dict(tmp_path)


@pytest.fixture
def train_dict(tmp_path: Path, tiny_sd3: Path):
    """A factory for a fast trainable recipe dict on the shared tiny model."""

    def make(**sections) -> dict:
        d = minimal_recipe_dict(tmp_path, tiny_sd3)
        d["reward"] = {"name": "brightness"}
        d["trainer"].update({"sample_every": 1})
        for k, v in sections.items():
            d.setdefault(k, {}).update(v)
        return d

    return make


@pytest.fixture
def recipe_file(tmp_path: Path) -> Path:
    p = tmp_path / "recipe.yaml"
    p.write_text(yaml.safe_dump(minimal_recipe_dict(tmp_path)))
    return p


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MPLBACKEND", "Agg")
