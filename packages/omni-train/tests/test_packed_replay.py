"""Packed replay: the update recomputes several SDE window steps of a micro-batch in one
forward (each row with its own timestep), as many as `algorithm.rows_per_forward` allows, and
the gradients equal the step-by-step replay's.

The gradients are read off one plain SGD step with learning rate 1 (``p <- p - grad``, no
clipping) on the tiny SD3's LoRA, from the same rollout batch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from omni_train_testutils import local_loop, rollout_and_score

from omni_train.algorithms import algorithm
from omni_train.recipe import recipe_from_dict
from omni_train.updates import UpdateContext, UpdateSettings, make_update_plans, run_update


def test_plan_takes_the_fewest_forwards_the_cap_allows():
    # 10 rows x 7 window steps, at most 16 rows per forward: 5 micro-batches of 2 rows with
    # all 7 steps packed (5 forwards of 14 rows), not 7 forwards of 10 rows
    (p,) = make_update_plans(
        10, num_minibatches=1, epochs=1, seed=0, step=0, rows_per_forward=16, items=7
    )
    (st,) = p.steps
    assert st.pack == 7 and [len(c) for c in st.chunks] == [2] * 5
    assert p.prepass_pack == 7 and len(p.prepass) == 5
    for cap, items in ((3, 7), (16, 2), (5, 4), (64, 7), (1, 3)):
        (p,) = make_update_plans(
            10, num_minibatches=1, epochs=1, seed=0, step=0, rows_per_forward=cap, items=items
        )
        for st in p.steps:
            assert all(len(c) * st.pack <= cap for c in st.chunks), (cap, items)
            assert sorted(r for c in st.chunks for r in c) == list(range(10))
    # no cap: the whole share in one forward per step
    (p,) = make_update_plans(10, num_minibatches=1, epochs=1, seed=0, step=0, items=7)
    assert p.steps[0].pack == 1 and len(p.steps[0].chunks) == 1


@pytest.mark.parametrize(
    "alg", [{"name": "flow_grpo", "kl_beta": 0.05}, {"name": "flow_dppo"}], ids=lambda a: a["name"]
)
def test_packed_replay_gradients_equal_the_step_by_step_replay(train_dict, tmp_path: Path, alg):
    d = train_dict(algorithm=alg, trainer={"sample_every": 0})
    d["rollout"].update({"num_steps": 5, "sde_window_size": 3, "sde_window_range": [0, 4]})
    recipe = recipe_from_dict(d)
    loop = local_loop(recipe, tmp_path / "run")
    trajs, rewards = rollout_and_score(loop)
    batch, _ = loop.update_batch(trajs, rewards, 0)
    n, steps = batch.log_probs.shape
    assert (n, steps) == (8, 3)
    adapter, params = loop.learner.adapter, loop.learner.params_named
    start = {k: v.detach().clone() for k, v in params.items()}
    # policy/kl_to_ref's forwards after the update left out (test_kl_metric.py has them)
    settings = dataclasses.replace(
        UpdateSettings.from_recipe(recipe), grad_clip=1e9, measure_kl_ref=False
    )
    rows_seen: list[int] = []
    hook = adapter.model.register_forward_pre_hook(
        lambda _m, args, kwargs: rows_seen.append(int(kwargs["hidden_states"].shape[0])),
        with_kwargs=True,
    )

    def gradients(rows_per_forward: int) -> tuple[dict[str, torch.Tensor], list[int]]:
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(start[k])
        sgd = torch.optim.SGD(list(params.values()), lr=1.0)
        ctx = UpdateContext(adapter, sgd, list(params.values()), algorithm(alg["name"]), settings)
        (plan,) = make_update_plans(
            n,
            num_minibatches=1,
            epochs=1,
            seed=0,
            step=0,
            rows_per_forward=rows_per_forward,
            items=steps,
        )
        rows_seen.clear()
        run_update(ctx, batch, plan)
        return {k: start[k] - p.detach() for k, p in params.items()}, list(rows_seen)

    step_by_step, forwards_1 = gradients(n)  # 8 rows per forward: one window step at a time
    packed, forwards_3 = gradients(n * steps)  # all 3 window steps of the 8 rows at once
    hook.remove()
    loop.ports.close()
    assert set(forwards_1) == {n} and set(forwards_3) == {n * steps}
    assert len(forwards_3) * steps == len(forwards_1)
    biggest = max(g.abs().max().item() for g in step_by_step.values())
    assert biggest > 1e-6  # the step trains something
    for k, g in step_by_step.items():  # to 1e-5, and to 1e-5 of the largest gradient entry
        assert (packed[k] - g).abs().max().item() <= 1e-5 * min(1.0, biggest), k


@pytest.mark.parametrize("name", ["flow_grpo", "grpo_guard"])
def test_update_metrics_are_the_minibatchs_whatever_the_split(train_dict, tmp_path: Path, name):
    """One-row micro-batches (`rows_per_forward: 1`) and the whole minibatch in one forward
    report the same metrics. The ratio's std is the minibatch's over every row and window
    step, not a mean of what each micro-batch and step saw (a one-row micro-batch's reads 0).
    The rollout's log-probs are shifted by noise ``z`` (std 0.05), so the ratio at the rollout
    weights is ``exp(-z)`` up to the replay's 1e-6 and its std is known."""
    d = train_dict(algorithm={"name": name}, trainer={"sample_every": 0})
    recipe = recipe_from_dict(d)
    loop = local_loop(recipe, tmp_path / "run")
    trajs, rewards = rollout_and_score(loop)
    batch, _ = loop.update_batch(trajs, rewards, 0)
    z = 0.05 * torch.randn(batch.log_probs.shape, generator=torch.Generator().manual_seed(0))
    batch = dataclasses.replace(batch, log_probs=batch.log_probs + z)
    n, steps = batch.log_probs.shape
    adapter, params = loop.learner.adapter, loop.learner.params_named
    start = {k: v.detach().clone() for k, v in params.items()}
    settings = dataclasses.replace(UpdateSettings.from_recipe(recipe), measure_kl_ref=False)

    def metrics(rows_per_forward: int) -> dict[str, float]:
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(start[k])
        sgd = torch.optim.SGD(list(params.values()), lr=1.0)
        ctx = UpdateContext(adapter, sgd, list(params.values()), algorithm(name), settings)
        (plan,) = make_update_plans(
            n, num_minibatches=1, epochs=1, seed=0, step=0, rows_per_forward=rows_per_forward
        )
        return run_update(ctx, batch, plan)

    one_row, whole = metrics(1), metrics(n * steps)
    loop.ports.close()
    assert sorted(one_row) == sorted(whole)
    assert not any(k.endswith("_dev_sq_mean") for k in whole)  # what the stds are made of
    for k, v in whole.items():
        if not k.startswith(("perf/", "timing/")):
            assert one_row[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    want = float(torch.exp(-z).std(unbiased=False))
    std = whole["actor/raw_ratio_std" if name == "grpo_guard" else "actor/ratio_std"]
    assert std == pytest.approx(want, rel=1e-3)
