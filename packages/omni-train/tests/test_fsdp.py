"""FSDP2 helpers: the shard plan, and the sharded update equal to LocalTrainer.update
(one gloo rank in this process; the 2-rank parity runs in test_ray_backend)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from omni_train.backends import fsdp
from omni_train.backends.ray_backend import _batch_tensors, _split
from omni_train.recipe import recipe_from_dict
from omni_train.trainer import LocalTrainer


def test_shard_plan_covers_each_minibatch_once():
    perms = [torch.randperm(12, generator=torch.Generator().manual_seed(e)) for e in range(2)]
    plans = fsdp.make_shard_plan(perms, 2, 4)
    for e in range(2):
        for k in range(2):
            got = sorted(
                p.rows[i]
                for p in plans
                for (ee, kk, pos) in p.steps
                if (ee, kk) == (e, k)
                for i in pos
            )
            assert got == sorted(perms[e][k * 6 : (k + 1) * 6].tolist())
    sizes = [len(pos) for (_, _, pos) in (p.steps[0] for p in fsdp.make_shard_plan(perms, 1, 5))]
    assert sorted(sizes) == [2, 2, 2, 3, 3] and all(p.minibatch_size == 6 for p in plans)
    assert [len(r) for r in _split(7, 3)] == [3, 2, 2] and len(_split(1, 3)) == 1


def test_unequal_split_weighting_gives_the_full_batch_gradient():
    # ranks back-propagate L_r * n_r * R / M and the reduce averages: equals grad of the mean
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(7, 3, generator=g)
    full = torch.autograd.grad((x @ w).pow(2).mean(), w)[0]
    parts = x.tensor_split(3)  # 3, 2, 2 rows
    R, M = len(parts), len(x)
    grads = [torch.autograd.grad((p @ w).pow(2).mean() * len(p) * R / M, w)[0] for p in parts]
    torch.testing.assert_close(sum(grads) / R, full)


@pytest.fixture
def one_rank():
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    fsdp.init_process_group(0, 1, "127.0.0.1", port, "gloo")
    yield
    dist.destroy_process_group()


def test_sharded_update_equals_local_update(tmp_path, one_rank):
    d = {
        "model": {"path": str(tmp_path / "model"), "tiny": "sd3"},
        "data": {"prompts": ["a red square", "a blue circle"], "prompts_per_step": 2},
        "rollout": {
            "n": 4,
            "height": 32,
            "width": 32,
            "num_steps": 4,
            "sde_window_size": 2,
            "sde_window_range": [0, 2],
        },
        "reward": {"name": "color_match"},
        "algorithm": {"name": "flow_grpo", "clip_range": 0.2, "num_minibatches": 2},
        "optimizer": {"lr": 1e-2},
        "trainer": {"output_dir": str(tmp_path / "run"), "progress": False, "threads": 1},
    }
    r = recipe_from_dict(d)
    local = LocalTrainer(r, tmp_path / "a")
    local.setup()
    batch = local.rollout(0)
    local.score(batch, 0)

    other = LocalTrainer(r, tmp_path / "b")
    other.setup()
    assert fsdp.shard_adapter(other.adapter) > 0
    params = other.adapter.named_trainable_parameters()
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=1e-4)

    from omni_train.backends.ray_backend import RayTrainer

    planner = RayTrainer(r, tmp_path / "c")
    planner.actors = [None]  # one rank
    adv, plans = planner.plan_update(batch, 0)
    got = fsdp.sharded_update(
        adapter=other.adapter,
        optimizer=opt,
        params=list(params.values()),
        loss_fn=local.loss_fn,
        recipe=r,
        sampling_params=local.params,
        data=_batch_tensors(batch.trajectories, plans[0].rows, adv),
        plan=plans[0],
        step=0,
    )
    want = local.update(batch, 0)
    for k in ("loss", "actor/grad_norm", "actor/ratio_mean", "rollout/logprob_diff_mean"):
        assert got[k] == pytest.approx(want[k], abs=1e-6), k
    mine = fsdp.gather_rollout_weights(other.adapter)
    ref = local.adapter.export_rollout_weights()
    for k in ref:
        torch.testing.assert_close(mine[k], ref[k], atol=1e-6, rtol=0)
    full = fsdp.gather_state_dict(other.adapter)
    assert len(full) > len(ref) and all("lora" not in k for k in list(full)[:1])
