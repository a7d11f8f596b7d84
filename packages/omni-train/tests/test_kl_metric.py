"""`policy/kl_to_ref` (LoRA, `kl_beta: 0`): the policy's KL to the LoRA-off reference after
the update, measured on `KL_METRIC_ROWS` rows spread over the first micro-batch, every window
step, in as few forwards as the prepass's memory cap allows."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omni_train_testutils import local_loop

from omni_algos.losses import kl_penalty
from omni_train.algorithms import algorithm
from omni_train.recipe import recipe_from_dict
from omni_train.updates import UpdateContext, UpdateSettings, make_update_plans, run_update
from omni_train.updates.common import KL_METRIC_ROWS, kl_metric_rows
from omni_train.updates.replay import replay_steps


def test_kl_metric_rows_spread_over_the_micro_batch() -> None:
    assert kl_metric_rows(list(range(48))) == [0, 12, 24, 36]
    assert kl_metric_rows(list(range(10))) == [0, 2, 4, 6]
    assert kl_metric_rows([5, 7]) == [5, 7]
    assert len(kl_metric_rows(list(range(1000)))) == KL_METRIC_ROWS


@pytest.mark.parametrize("rows_per_forward", [None, 4], ids=["uncapped", "capped-4"])
def test_kl_to_ref_costs_a_few_rows_and_equals_the_step_by_step_kl(
    train_dict, tmp_path: Path, rows_per_forward
) -> None:
    d = train_dict(algorithm={"name": "flow_grpo", "clip_range": 0.2}, trainer={"sample_every": 0})
    d["rollout"].update({"num_steps": 5, "sde_window_size": 3, "sde_window_range": [0, 4]})
    recipe = recipe_from_dict(d)
    loop = local_loop(recipe, tmp_path / "run")
    adapter, params = loop.learner.adapter, loop.learner.params_named
    trajs = loop.ports.rollout.generate_many(loop.requests_for(0))
    rewards, _, _ = loop.score(trajs, 0)
    batch, _ = loop.update_batch(trajs, rewards, 0)
    n, steps = batch.log_probs.shape
    assert (n, steps) == (8, 3)

    settings = UpdateSettings.from_recipe(recipe)
    assert settings.measure_kl_ref  # on by default with LoRA and kl_beta 0
    sgd = torch.optim.SGD(list(params.values()), lr=1.0)  # a large step: the KL is not 0
    ctx = UpdateContext(adapter, sgd, list(params.values()), algorithm("flow_grpo"), settings)
    (plan,) = make_update_plans(
        n, num_minibatches=1, epochs=1, seed=0, step=0, items=steps,
        rows_per_forward=rows_per_forward,
    )  # fmt: skip
    forwards: list[int] = []
    hook = adapter.model.register_forward_pre_hook(
        lambda _m, args, kwargs: forwards.append(int(kwargs["hidden_states"].shape[0])),
        with_kwargs=True,
    )
    metrics = run_update(ctx, batch, plan)
    hook.remove()
    n_update = sum(len(st.chunks) * math.ceil(steps / st.pack) for st in plan.steps)
    assert sum(forwards[:n_update]) == n * steps  # the update's own forwards
    metric = forwards[n_update:]  # policy and reference, each over 4 rows x 3 steps
    assert sum(metric) == 2 * KL_METRIC_ROWS * steps
    # as many steps per forward as the prepass's forwards hold rows (the memory cap)
    assert metric == ([8, 8, 4, 4] if rows_per_forward is None else [4] * 6)

    # the value: the mean over those rows and window steps of the step Gaussians' KL,
    # one step per forward here
    rows = kl_metric_rows(plan.prepass[0])
    kls = []
    for j in range(steps):
        (now,) = replay_steps(adapter, batch, rows, [j], grad=False)
        (ref,) = replay_steps(adapter, batch, rows, [j], grad=False, reference=True)
        kls.append(kl_penalty(now.mean, ref.mean, now.step_std).metrics["kl"])
    expected = sum(kls) / steps
    assert expected > 0.0
    assert metrics["policy/kl_to_ref"] == pytest.approx(expected, rel=1e-4)
    loop.ports.close()
