"""Shared helpers for omni-train tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # omni_train_testutils
# read by Ray when first imported: no repo zip or uv rebuild for the local test workers
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
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


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test run (its start-up is slow)."""
    ray = pytest.importorskip("ray")
    from omni_train.backends.ray import start_ray

    if not ray.is_initialized():
        start_ray(num_cpus=2)
    # Ray writes the cluster's auth token under the HOME it started with; the tests' HOME
    # changes per test, so point later drivers (a CLI run with RAY_ADDRESS) at the file
    token = Path(os.environ["HOME"]) / ".ray" / "auth_token"
    if token.is_file():
        os.environ.setdefault("RAY_AUTH_TOKEN_PATH", str(token))
    yield ray
    ray.shutdown()
