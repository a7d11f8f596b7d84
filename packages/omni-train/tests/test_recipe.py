from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from omni_train.recipe import (
    Recipe,
    RecipeError,
    apply_overrides,
    dump_recipe,
    load_recipe,
    parse_override,
    recipe_from_dict,
    valid_keys,
)

REPO = Path(__file__).resolve().parents[3]


def test_load_minimal_and_defaults(recipe_file: Path) -> None:
    r = load_recipe(recipe_file)
    assert isinstance(r, Recipe)
    assert r.rollout.n == 4
    assert r.algorithm.name == "flow_grpo"
    assert r.optimizer.lr == pytest.approx(3e-4)
    assert r.trainer.seed == 0
    assert r.output_dir() == Path(r.trainer.output_dir)


def test_overrides_parse_yaml_scalars(recipe_file: Path, tmp_path: Path) -> None:
    r = load_recipe(
        recipe_file,
        [
            "trainer.steps=7",
            "trainer.seed=3",
            f"trainer.output_dir={tmp_path}/x",
            "optimizer.lr=1e-3",
            "lora.target_modules=[to_q, to_k]",
            "trainer.tensorboard=true",
        ],
    )
    assert r.trainer.steps == 7 and isinstance(r.trainer.steps, int)
    assert r.trainer.seed == 3
    assert r.trainer.output_dir == f"{tmp_path}/x"
    assert r.optimizer.lr == pytest.approx(1e-3)
    assert r.lora.target_modules == ["to_q", "to_k"]
    assert r.trainer.tensorboard is True


def test_override_creates_missing_section(recipe_dict) -> None:
    d = recipe_dict()
    d.pop("trainer")
    apply_overrides(d, ["trainer.steps=2"])
    assert recipe_from_dict(d).trainer.steps == 2


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("rollout.nn=4", "unknown key 'rollout.nn' (did you mean 'rollout.n'?)"),
        ("trainer.stpes=4", "did you mean 'trainer.steps'"),
        ("trainer.lr=0.1", "did you mean 'optimizer.lr'"),
        ("optimzer.lr=0.1", "did you mean 'optimizer'"),
        ("rollout.n=abc", "'rollout.n': Input should be a valid integer"),
        ("rollout.n=1", "'rollout.n'"),
        ("trainer.steps=2.5", "'trainer.steps'"),
        ("rollout.sde_kind=foo", "'rollout.sde_kind'"),
    ],
)
def test_bad_keys_and_types_name_the_key(recipe_file: Path, override: str, needle: str) -> None:
    with pytest.raises(RecipeError) as exc:
        load_recipe(recipe_file, [override])
    assert needle in str(exc.value)


def test_unknown_key_in_yaml_file(recipe_dict, tmp_path: Path) -> None:
    d = recipe_dict()
    d["rollout"]["noise_levle"] = 0.5
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(RecipeError, match=r"did you mean 'rollout.noise_level'"):
        load_recipe(p)


def test_several_problems_reported_together(recipe_dict) -> None:
    d = recipe_dict()
    d["rollout"]["n"] = "x"
    d["trainer"]["bogus"] = 1
    with pytest.raises(RecipeError) as exc:
        recipe_from_dict(d)
    msg = str(exc.value)
    assert "'rollout.n'" in msg and "'trainer.bogus'" in msg


def test_missing_required_and_cross_field(recipe_dict) -> None:
    d = recipe_dict()
    d.pop("model")
    with pytest.raises(RecipeError, match="missing required key 'model'"):
        recipe_from_dict(d)
    d = recipe_dict()
    d["reward"] = {}
    with pytest.raises(
        RecipeError, match=re.escape("exactly one of `reward.name` or `reward.terms`")
    ):
        recipe_from_dict(d)
    d = recipe_dict()
    d["algorithm"] = {"num_minibatches": 3}
    with pytest.raises(RecipeError, match=re.escape("algorithm.num_minibatches")):
        recipe_from_dict(d)
    d = recipe_dict()
    d["rollout"]["sde_window_range"] = [0, 9]
    with pytest.raises(RecipeError, match=re.escape("rollout.sde_window_range")):
        recipe_from_dict(d)


@pytest.mark.parametrize(
    ("section", "value", "key"),
    [
        ("reward", {"name": "latent", "inputs": ["latents"]}, "reward.inputs"),
        ("optimizer", {"grad_accumulation": 2}, "optimizer.grad_accumulation"),
    ],
)
def test_what_backend_ray_cannot_do_yet_is_named(recipe_dict, section, value, key) -> None:
    d = recipe_dict()
    d[section] = {**d.get(section, {}), **value}
    recipe_from_dict(d)  # fine on the local backend
    d["trainer"] = {**d.get("trainer", {}), "backend": "ray"}
    with pytest.raises(RecipeError, match=re.escape(key) + r": .*backend ray"):
        recipe_from_dict(d)


@pytest.mark.parametrize("bad", ["noequals", "=3", "a..b=3", "trainer.steps=[1"])
def test_malformed_overrides(bad: str) -> None:
    with pytest.raises(RecipeError):
        apply_overrides({}, [bad])


def test_override_into_value_is_error(recipe_dict) -> None:
    d = recipe_dict()
    with pytest.raises(RecipeError, match=re.escape("'trainer.steps' is a value")):
        apply_overrides(d, ["trainer.steps.x=1"])


def test_parse_override_types() -> None:
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=0.5") == (["a"], 0.5)
    assert parse_override("a=null") == (["a"], None)
    assert parse_override("a=hello world") == (["a"], "hello world")
    assert parse_override("a=x=y") == (["a"], "x=y")


def test_dump_roundtrip(recipe_file: Path, tmp_path: Path) -> None:
    r = load_recipe(recipe_file, ["trainer.steps=5"])
    p = tmp_path / "dumped.yaml"
    p.write_text(dump_recipe(r))
    assert load_recipe(p) == r


def test_valid_keys_cover_sections() -> None:
    keys = valid_keys()
    for k in ("rollout.n", "trainer.seed", "optimizer.lr", "lora.rank", "reward.terms.weight"):
        assert k in keys


def test_shipped_recipes_validate() -> None:
    recipes = sorted((REPO / "recipes").glob("**/*.yaml"))
    assert recipes, "no recipes shipped"
    for p in recipes:
        load_recipe(p)


def test_docs_reference_every_key() -> None:
    doc = (REPO / "docs" / "recipes.md").read_text()
    missing = [k for k in valid_keys() if f"`{k}`" not in doc]
    assert not missing, f"docs/recipes.md lacks {missing}; regenerate: python -m omni_train.recipe"
