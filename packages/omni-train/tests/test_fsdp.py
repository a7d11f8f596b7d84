"""The update plan (rows per rank and micro-batch, in lockstep) and the FSDP2 path of the one
update step in this process (one gloo rank; the 2-rank parity runs in test_ray_backend)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from omni_train_testutils import local_loop, minimal_recipe, rollout_and_score

from omni_train.backends import fsdp
from omni_train.backends.local import LocalLearner
from omni_train.models import load_policy
from omni_train.recipe import recipe_from_dict
from omni_train.updates import (
    UpdateContext,
    UpdateSettings,
    make_update_plans,
    minibatch_orders,
    run_update,
    select_rows,
    update_plans,
)


def test_plans_cover_each_minibatch_once_in_lockstep():
    for n, k, world, cap in ((12, 2, 4, None), (12, 2, 3, 2), (7, 1, 5, 1), (3, 2, 2, 1)):
        orders = minibatch_orders(n, k, 2, seed=0, step=3)
        plans = make_update_plans(
            n, num_minibatches=k, epochs=2, seed=0, step=3, world_size=world, rows_per_forward=cap
        )
        assert len(plans) == world
        for s, step in enumerate(plans[0].steps):
            got = sorted(
                p.rows[i]
                for p in plans
                for c, d in zip(p.steps[s].chunks, p.steps[s].dummy)
                if not d
                for i in c
            )
            assert got == sorted(orders[step.epoch][step.minibatch])
            # every rank runs the same forwards: same micro-batch count and packing
            assert len({len(p.steps[s].chunks) for p in plans}) == 1
            assert len({p.steps[s].pack for p in plans}) == 1
            for p in plans:
                assert all(len(c) <= (cap or n) for c in p.steps[s].chunks)
        assert len({len(p.prepass) for p in plans}) == 1
        for p in plans:  # the prepass covers every row a rank holds
            assert sorted({i for c in p.prepass for i in c}) == list(range(len(p.rows)))
    # more ranks than rows in a minibatch: the short rank runs a dummy (weight 0) micro-batch
    (_, b) = make_update_plans(3, num_minibatches=2, epochs=1, seed=0, step=0, world_size=2)
    assert [s.dummy for s in b.steps] == [[True], [True]] and b.rows
    # 2 window steps, micro-batches of 2 rows, rows_per_forward 4: both steps in one forward
    (p,) = make_update_plans(
        8, num_minibatches=4, epochs=1, seed=0, step=0, rows_per_forward=4, items=2
    )
    assert all(s.pack == 2 for s in p.steps)


@pytest.fixture
def one_rank():
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    fsdp.init_process_group(0, 1, "127.0.0.1", port, "gloo")
    yield
    dist.destroy_process_group()


def test_fsdp_update_equals_local_update(tmp_path, one_rank, tiny_sd3):
    sections = {
        "algorithm": {
            "name": "grpo_guard",
            "clip_range": 0.2,
            "num_minibatches": 2,
            "kl_beta": 0.1,
        },
        "optimizer": {"lr": 1e-2, "eps": 1e-4},
    }
    d = minimal_recipe(tmp_path / "run", tiny_sd3, sections, threads=1)
    r = recipe_from_dict(d)
    loop = local_loop(r, tmp_path / "a")
    trajs, rewards = rollout_and_score(loop)
    batch, _ = loop.update_batch(trajs, rewards, 0)
    want = loop.learner.update(batch, 0)
    ref = loop.learner.rollout_weights()
    loop.ports.close()

    other = load_policy(r)
    assert fsdp.shard_adapter(other) > 0
    mirror = LocalLearner(r, other)  # the optimizer over the sharded parameters
    ctx = UpdateContext(
        other,
        mirror.optimizer,
        list(mirror.params_named.values()),
        mirror.ctx.algorithm,
        UpdateSettings.from_recipe(r),
        fsdp.DistCollective(),
    )
    (plan,) = update_plans(r, batch, 0, world_size=1)
    got = run_update(ctx, select_rows(batch, plan.rows), plan)
    for k in ("loss", "actor/grad_norm", "actor/ratio_mean", "actor/kl_ref"):
        assert got[k] == pytest.approx(want[k], abs=1e-6), k
    mine = fsdp.gather_rollout_weights(other)
    for k in ref:
        torch.testing.assert_close(mine[k], ref[k], atol=1e-6, rtol=0)
    # the gathered optimizer state loads back into the shards
    state = fsdp.gather_optimizer_state(mirror.optimizer)
    assert all(not hasattr(v, "placements") for st in state["state"].values() for v in st.values())
    fsdp.load_optimizer_state(mirror.optimizer, state)
