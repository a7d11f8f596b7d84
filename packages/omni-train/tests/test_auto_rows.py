"""`algorithm.rows_per_forward: auto`: the update's rows per forward chosen by memory
(`omni_train.updates.auto_rows`), measured on the model's own transformer blocks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omni_train_testutils import local_loop, rollout_and_score

from omni_adapters.memory import activation_bytes
from omni_train.recipe import RecipeError, recipe_from_dict
from omni_train.train import train
from omni_train.updates import update_plans
from omni_train.updates.auto_rows import (
    CPU_FORWARD_BYTES,
    CPU_FORWARD_ROWS,
    CPU_SHARE,
    RowsBudget,
    free_memory_bytes,
    rows_within,
)


def _auto(train_dict, **sections) -> dict:
    d = train_dict(algorithm={"rows_per_forward": "auto"}, trainer={"sample_every": 0})
    d["rollout"].update({"num_steps": 5, "sde_window_size": 3, "sde_window_range": [0, 4]})
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return d


def test_budget_measures_a_training_forward_and_plans_the_next_update(train_dict, tmp_path):
    recipe = recipe_from_dict(_auto(train_dict))
    loop = local_loop(recipe, tmp_path / "run")
    learner = loop.learner
    budget = learner.rows_budget
    assert isinstance(budget, RowsBudget) and budget.rows_fit() is None
    trajs, rewards = rollout_and_score(loop)  # no-grad forwards: nothing measured
    assert budget.token_width == 0 and budget.rows_fit() is None
    batch, _ = loop.update_batch(trajs, rewards, 0)
    n, items = batch.log_probs.shape
    assert (n, items) == (8, 3)

    # the first update runs at rollout.max_num_seqs rows per forward (nothing measured)
    (first,) = update_plans(recipe, batch, 0, 1, rows_fit=learner.rows_fit)
    (default,) = update_plans(recipe_from_dict({**recipe.model_dump(), "algorithm": {
        **recipe.algorithm.model_dump(), "rows_per_forward": None}}), batch, 0, 1)  # fmt: skip
    assert first.steps[0].chunks == default.steps[0].chunks
    metrics = learner.update(batch, 0)

    # what the first block took: image tokens and text tokens, each at the model's width
    tf = learner.adapter.model
    hidden = tf.config.num_attention_heads * tf.config.attention_head_dim
    patch = tf.config.patch_size
    _, _, h, w = batch.latents.shape[1:]
    text = batch.condition["prompt_embeds"].shape[1]
    assert budget.token_width == (h // patch * (w // patch) + text) * hidden
    assert budget.element_bytes == 4 and budget.layers == tf.config.num_layers
    per_row = activation_bytes(1, budget.token_width, budget.layers, element_bytes=4)
    assert budget.rows_fit(free_bytes=10 * per_row / CPU_SHARE) == 8  # a power of two
    assert budget.rows_fit(free_bytes=16 * per_row / CPU_SHARE) == 16
    # plenty of memory: a CPU forward stops at CPU_FORWARD_BYTES of activations and at
    # CPU_FORWARD_ROWS rows
    cap = 1 << (math.floor(CPU_FORWARD_BYTES / per_row).bit_length() - 1)
    assert budget.rows_fit(free_bytes=1e15) == min(cap, CPU_FORWARD_ROWS)
    budget.element_bytes = 4096  # (a model whose rows take 1000x the bytes: the bytes cap)
    big = activation_bytes(1, budget.token_width, budget.layers, element_bytes=4096)
    assert budget.rows_fit(free_bytes=1e15) == 1 << (
        math.floor(CPU_FORWARD_BYTES / big).bit_length() - 1
    )
    budget.element_bytes = 4
    assert budget.rows_fit(free_bytes=0.0) == 1  # never below one row
    assert metrics["perf/rows_fit"] == learner.rows_fit >= n * items  # a CPU holds them all

    # from the second update on: the whole minibatch, all window steps, in one forward
    (second,) = update_plans(recipe, batch, 1, 1, rows_fit=learner.rows_fit)
    assert second.steps[0].pack == items and len(second.steps[0].chunks) == 1
    assert len(default.steps[0].chunks) * math.ceil(items / default.steps[0].pack) > 1
    learner.close()
    loop.ports.close()


def test_guidance_counts_both_branches(train_dict, tmp_path):
    recipe = recipe_from_dict(_auto(train_dict, rollout={"guidance_scale": 3.0}))
    loop = local_loop(recipe, tmp_path / "run")
    budget = loop.learner.rows_budget
    assert budget.branches == 2
    budget.token_width, budget.element_bytes = 1000, 4
    assert budget.bytes_per_row() == 2 * activation_bytes(1, 1000, budget.layers, element_bytes=4)
    loop.learner.close()
    loop.ports.close()


def test_rows_within_is_the_power_of_two_that_fits():
    assert [rows_within(b, 1.0) for b in (0.0, -5.0, 1.0, 7.9, 8.0, 1000.0)] == [1, 1, 1, 4, 8, 512]
    assert rows_within(3 * 2**20, 2**20) == 2


def test_free_memory_is_read_from_the_system():
    free = free_memory_bytes(torch.device("cpu"))
    assert 0 < free < 2**50


def test_auto_run_trains_like_the_default(train_dict, tmp_path: Path):
    """Two steps with `auto` and with the default: the same rewards (the split changes only
    the order of additions), and `perf/rows_fit` logged at each update."""
    runs = {}
    for name, rows in (("auto", "auto"), ("default", None)):
        d = _auto(train_dict, trainer={"output_dir": str(tmp_path / name), "steps": 3})
        d["algorithm"]["rows_per_forward"] = rows
        runs[name] = [r for r in train(recipe_from_dict(d)) if "reward/mean" in r]
    assert [r["step"] for r in runs["auto"]] == [1, 2, 3]
    assert all(r["perf/rows_fit"] >= 24 for r in runs["auto"])
    assert all("perf/rows_fit" not in r for r in runs["default"])
    for a, b in zip(runs["auto"], runs["default"]):
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-4)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


@pytest.mark.parametrize(
    ("value", "backend", "message"),
    [
        ("many", "local", "algorithm.rows_per_forward"),
        (0, "local", "algorithm.rows_per_forward"),
        ("auto", "verl", "algorithm.rows_per_forward: sizes the local and ray backends"),
        (4, "verl", "algorithm.rows_per_forward: sizes the local and ray backends"),
    ],
)
def test_bad_rows_per_forward_is_refused(train_dict, value, backend, message):
    d = train_dict(algorithm={"rows_per_forward": value}, trainer={"backend": backend})
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(d)
