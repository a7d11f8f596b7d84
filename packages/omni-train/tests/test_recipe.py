from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from omni_train.algorithms import ALGORITHMS
from omni_train.recipe import (
    Recipe,
    RecipeError,
    apply_overrides,
    dump_recipe,
    load_recipe,
    parse_override,
    recipe_from_dict,
    reference_markdown,
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
            "trainer.report_to=[tensorboard]",
        ],
    )
    assert r.trainer.steps == 7 and isinstance(r.trainer.steps, int)
    assert r.trainer.seed == 3
    assert r.trainer.output_dir == f"{tmp_path}/x"
    assert r.optimizer.lr == pytest.approx(1e-3)
    assert r.lora.target_modules == ["to_q", "to_k"]
    assert r.trainer.report_to == ["tensorboard"]


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


def _with(d: dict, **sections) -> dict:
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return d


def _omni(d: dict) -> dict:
    """The minimal recipe turned into the thinker's: a generated task, the choice reward, and
    none of the diffusion sampler's keys."""
    d = _with(d, model={"tiny": "qwen3_omni_thinker"})
    d["data"] = {"task": "shapes", "prompts_per_step": 2}
    d["reward"] = {"name": "choice"}
    d["rollout"] = {"n": 4}
    return d


def _diffusion_ok(d: dict, name: str) -> dict:
    """The minimal recipe made valid for a diffusion algorithm."""
    d = _with(d, algorithm={"name": name})
    if name == "dance_grpo":
        d["rollout"]["sde_kind"] = "dance"
    return d


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_algorithm_table_refuses_what_does_not_run(recipe_dict, name) -> None:
    """Every backend and mode an algorithm's row does not list is refused by key; those it
    lists validate."""
    row = ALGORITHMS[name]
    base = recipe_dict()
    if row.model == "omni":
        base = _omni(base)
    base = _diffusion_ok(base, name)
    for backend in ("local", "ray", "verl"):
        for mode in ("sync", "async"):
            d = _with(base, trainer={"backend": backend, "mode": mode})
            if backend in row.backends and mode in row.modes:
                recipe_from_dict(d)
                continue
            key = "trainer.backend" if backend not in row.backends else "trainer.mode"
            with pytest.raises(RecipeError, match=re.escape(key) + f": {name} runs"):
                recipe_from_dict(d)


@pytest.mark.parametrize("name", ["flow_dppo", "diffusion_nft", "diffusion_dpo"])
def test_clip_range_is_refused_where_the_loss_has_no_ratio_clip(recipe_dict, name) -> None:
    d = _with(recipe_dict(), algorithm={"name": name, "clip_range": 0.2})
    d["algorithm"].pop("mix_window", None)
    with pytest.raises(RecipeError, match=re.escape(f"algorithm.clip_range: {name}'s loss")):
        recipe_from_dict(d)
    d["algorithm"]["clip_range"] = None
    assert recipe_from_dict(d).algorithm.clip_range is None


def test_validation_prompts_come_from_one_place(recipe_dict, tmp_path) -> None:
    """`data.val_prompts` and `data.val_file` together: refused (the file used to win
    silently)."""
    val = tmp_path / "val.txt"
    val.write_text("a red circle\n")
    d = _with(recipe_dict(), data={"val_prompts": ["a blue square"], "val_file": str(val)})
    with pytest.raises(RecipeError, match=re.escape("data.val_prompts, data.val_file")):
        recipe_from_dict(d)


@pytest.mark.parametrize(
    ("name", "algorithm", "key"),
    [
        ("flow_grpo", {"train_timesteps": 4}, "algorithm.train_timesteps: flow_grpo"),
        ("mix_grpo", {"timestep_range": [0.2, 0.8]}, "algorithm.timestep_range: mix_grpo"),
        ("diffusion_dpo", {"adv_std": "none"}, "algorithm.adv_std: diffusion_dpo"),
        ("diffusion_dpo", {"adv_clip_max": 2.0}, "algorithm.adv_clip_max: diffusion_dpo"),
    ],
)
def test_algorithm_keys_the_algorithm_does_not_read_are_refused(
    recipe_dict, name, algorithm, key
) -> None:
    """A key set to other than its default where the algorithm never reads it: refused by
    name, not ignored (their defaults pass, so recipes that write them out still load)."""
    d = _with(recipe_dict(), algorithm={"name": name, **algorithm})
    with pytest.raises(RecipeError, match=re.escape(key)):
        recipe_from_dict(d)
    field = key.split(":")[0].removeprefix("algorithm.")
    d["algorithm"][field] = recipe_from_dict(
        _with(recipe_dict(), algorithm={"name": name})
    ).algorithm.model_dump()[field]
    recipe_from_dict(d)


@pytest.mark.parametrize(
    ("omni", "section", "key", "value"),
    [
        (False, "rollout", "allowed_tokens", ["A", "B"]),
        (False, "rollout", "max_new_tokens", 8),
        (False, "rollout", "temperature", 0.7),
        (False, "reward", "extract", "first_letter"),
        (True, "rollout", "num_steps", 8),
        (True, "rollout", "guidance_scale", 4.5),
        (True, "rollout", "sde_window_range", [0, 3]),
        (True, "trainer", "val_samples_per_prompt", 4),
        (True, "trainer", "val_num_steps", 20),
    ],
)
def test_keys_of_the_other_loop_are_refused(recipe_dict, omni, section, key, value) -> None:
    """A diffusion model decodes no tokens and an omni model samples no images: their loops'
    own keys set on the other path are refused by name (their defaults pass)."""
    from omni_train.recipe import DIFFUSION_ONLY_KEYS, OMNI_ONLY_KEYS

    assert key in (DIFFUSION_ONLY_KEYS if omni else OMNI_ONLY_KEYS)[section]
    d = _with(_omni(recipe_dict()), algorithm={"name": "gspo"}) if omni else recipe_dict()
    recipe = recipe_from_dict(d)
    assert recipe.is_omni() == omni
    with pytest.raises(RecipeError, match=re.escape(f"{section}.{key}: only the")):
        recipe_from_dict(_with(d, **{section: {key: value}}))
    default = getattr(getattr(recipe, section), key)
    recipe_from_dict(_with(d, **{section: {key: default}}))  # written out at its default


def test_reward_options_beside_terms_are_refused(recipe_dict) -> None:
    terms = [{"name": "brightness", "weight": 1.0}]
    d = _with(recipe_dict(), reward={"name": None, "terms": terms, "options": {"x": 1}})
    with pytest.raises(RecipeError, match=re.escape("reward.options: with reward.terms")):
        recipe_from_dict(d)


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        (
            {"trainer": {"backend": "ray"}, "reward": {"inputs": ["media", "audio"]}},
            "reward.inputs",
        ),
        ({"trainer": {"backend": "ray"}, "optimizer": {"ema_decay": 0.9}}, "optimizer.ema_decay"),
        ({"trainer": {"mode": "async"}, "optimizer": {"ema_decay": 0.9}}, "optimizer.ema_decay"),
        # a remote rollout holds the live weights: validation would not sample the EMA
        (
            {"rollout": {"backend": "http"}, "optimizer": {"ema_decay": 0.9}},
            "optimizer.ema_decay",
        ),
        (
            {"algorithm": {"name": "diffusion_dpo", "rollout_correction": "decoupled"}},
            "algorithm.rollout_correction",
        ),
        ({"algorithm": {"name": "diffusion_nft", "kl_beta": 0.1}}, "algorithm.kl_beta"),
        ({"algorithm": {"name": "dance_grpo"}}, "rollout.sde_kind"),
        ({"algorithm": {"name": "gspo"}}, "algorithm.name"),  # a token algorithm on SD3
        ({"algorithm": {"name": "kl_penalty"}}, "algorithm.name"),  # a term, not an algorithm
        ({"algorithm": {"name": "flowgrpo"}}, "algorithm.name"),
        # only mix_grpo reads the sliding window: set for another algorithm it would be ignored
        ({"algorithm": {"mix_window": {"ode_stride": 1}}}, "algorithm.mix_window"),
        # the re-noising t is the forward-process losses' (diffusion_nft, diffusion_dpo)
        ({"algorithm": {"timestep_sampling": "schedule"}}, "algorithm.timestep_sampling"),
        # preference pairs are online DPO's; NFT trains on every sample
        (
            {"algorithm": {"name": "diffusion_nft", "pairs_per_group": 4}},
            "algorithm.pairs_per_group",
        ),
    ],
)
def test_unsupported_combinations_are_named(recipe_dict, changes, key) -> None:
    d = _with(recipe_dict(), **changes)
    with pytest.raises(RecipeError, match=re.escape(key)):
        recipe_from_dict(d)


def test_the_quickstart_runs_as_flowgrpo_with_its_mix_window_section() -> None:
    """docs/toy_world.md turns the quickstart into FlowGRPO by overrides; its mix_window
    section keeps the defaults, so the other algorithms accept it. Flow-DPPO has no ratio
    clip: the quickstart's `clip_range` is refused for it until the override drops it."""
    path = REPO / "recipes" / "quickstart.yaml"
    if not path.is_file():
        pytest.skip("the repository's recipes/ folder is not next to this package")
    for name in ("flow_grpo", "flow_dppo", "grpo_guard"):
        over = [f"algorithm.name={name}", "rollout.sde_window_size=3"]
        if name == "flow_dppo":
            with pytest.raises(RecipeError, match=re.escape("algorithm.clip_range: flow_dppo")):
                load_recipe(path, over)
            over.append("algorithm.clip_range=null")
        recipe = load_recipe(path, over)
        assert recipe.algorithm.name == name


def test_renamed_key_says_what_to_write(recipe_dict) -> None:
    d = _with(recipe_dict(), optimizer={"grad_accumulation": 2})
    with pytest.raises(
        RecipeError,
        match=r"optimizer.grad_accumulation' was renamed: use algorithm\.rows_per_forward",
    ):
        recipe_from_dict(d)


def test_flowgrpo_suggests_the_algorithm(recipe_dict) -> None:
    d = _with(recipe_dict(), algorithm={"name": "flowgrpo"})
    with pytest.raises(RecipeError, match=r"did you mean 'flow_grpo'"):
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
    # the embedded reference is the schema's, word for word: a changed description, default or
    # section docstring shows here until the doc is regenerated
    start, end = "<!-- keys:start -->\n", "<!-- keys:end -->"
    embedded = doc[doc.index(start) + len(start) : doc.index(end)]
    assert embedded == reference_markdown(), "docs/recipes.md is stale: python -m omni_train.recipe"


def test_reference_section_text_is_the_docstrings_first_paragraph() -> None:
    """A section's text is its docstring's first paragraph whole, not its first line."""
    text = reference_markdown()
    assert "Li et al. 2025, arXiv 2507.21802): at training step s" in text
    assert "so a resumed run continues it exactly" in text
