"""trainer.backend: ray on CPU: 2 FSDP2 actor workers on gloo, 2 rollout workers, 1 reward.

One Ray session and one RayTrainer per module (Ray and worker start-up dominate the time);
the fixture runs step 0 on both backends first so the parity check sees fresh weights.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from diffusion_rollout.wire import tensors_from_bytes  # noqa: E402
from omni_adapters import weights_checksum  # noqa: E402
from omni_train.backends.fsdp import make_shard_plan  # noqa: E402
from omni_train.backends.ray_backend import RayTrainer, pool_sizes  # noqa: E402
from omni_train.errors import TrainError  # noqa: E402
from omni_train.logger import MetricsLogger  # noqa: E402
from omni_train.recipe import RecipeError, recipe_from_dict  # noqa: E402
from omni_train.trainer import LocalTrainer  # noqa: E402


def tiny_recipe(tmp, **trainer) -> dict:
    return {
        "experiment": "ray",
        "model": {"path": str(tmp / "model"), "tiny": "sd3"},
        "data": {"prompts": ["a red square", "a blue circle"], "prompts_per_step": 2},
        "rollout": {
            "n": 4,
            "height": 32,
            "width": 32,
            "num_steps": 4,
            "sde_window_size": 2,
            "sde_window_range": [0, 2],
            "noise_level": 0.8,
        },
        "reward": {"name": "color_match"},
        "algorithm": {"name": "flow_grpo", "clip_range": 0.2},
        # Adam's first step is lr * g / (|g| + eps): with the default eps 1e-8, a gradient entry
        # near 1e-9 turns reduction-order rounding (2 FSDP ranks vs 1 process) into a 1e-4 weight
        # difference. eps 1e-4 bounds that amplification at lr / eps = 100x a gradient difference.
        "optimizer": {"lr": 1e-2, "eps": 1e-4},
        "trainer": {
            "steps": 4,
            "output_dir": str(tmp / "run"),
            "progress": False,
            "threads": 1,
            "sample_every": 0,
            **trainer,
        },
    }


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    if not ray.is_initialized():  # one Ray session for the whole test run (start-up is slow)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    local = LocalTrainer(recipe_from_dict(tiny_recipe(tmp)), tmp / "local")
    local.setup()
    lb = local.rollout(0)
    local.score(lb, 0)
    lm = local.update(lb, 0)
    rt = RayTrainer(recipe_from_dict(tiny_recipe(tmp, backend="ray", num_workers=2)), tmp / "r")
    rt.setup()
    rb = rt.rollout(0)
    rt.score(rb, 0)
    rm = rt.update(rb, 0)
    yield {
        "tmp": tmp,
        "local": local,
        "lb": lb,
        "lm": lm,
        "rt": rt,
        "rb": rb,
        "rm": rm,
        "lw": local.adapter.export_rollout_weights(),
        "rw": tensors_from_bytes(rt.gather_weights())[0],
    }
    rt.close()


def test_parity_loss_and_weights_after_one_step(session):
    lm, rm = session["lm"], session["rm"]
    assert rm["loss"] == pytest.approx(lm["loss"], abs=1e-5)
    assert rm["actor/grad_norm"] == pytest.approx(lm["actor/grad_norm"], rel=1e-4)
    lw, rw = session["lw"], session["rw"]
    assert sorted(lw) == sorted(rw)
    moved = max(float(lw[k].abs().max()) for k in lw if "lora_B" in k)
    assert moved > 1e-3  # the step did change the LoRA weights
    for k in lw:
        torch.testing.assert_close(rw[k], lw[k], atol=1e-5, rtol=0, msg=k)


def test_rollout_seeds_independent_of_split(session):
    lb, rb = session["lb"], session["rb"]
    assert rb.seeds == lb.seeds and rb.group_ids == lb.group_ids
    assert len(rb.trajectories) == 8
    for a, b in zip(lb.trajectories, rb.trajectories):
        assert a.request_id == b.request_id and a.window == b.window
        torch.testing.assert_close(b.latents, a.latents, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.log_probs, a.log_probs, atol=1e-4, rtol=0)
    np.testing.assert_allclose(rb.rewards, lb.rewards, atol=1e-5)


def test_weight_sync_is_versioned_lora_fast_path(session):
    rt = session["rt"]
    rt.sync_weights(1)
    want = weights_checksum(session["rw"])
    got = ray.get([h.checksum.remote() for h in rt.engine.pool.handles])
    assert got == [want, want]
    b = rt.rollout(1)
    assert {t.version for t in b.trajectories} == {1}
    # full weights when asked: every weight of the transformer goes across
    payload = tensors_from_bytes(rt.gather_weights(full=True))[0]
    assert len(payload) > len(session["rw"]) and any("lora" not in k for k in payload)
    rt.sync_weights(2, full=True)
    assert ray.get([h.checksum.remote() for h in rt.engine.pool.handles]) == [want, want]
    with pytest.raises(ray.exceptions.RayTaskError, match="not newer"):
        ray.get(rt.engine.pool.handles[0].update_weights.remote(rt.gather_weights(), 1))
    rt.engine.sleep()  # between phases the rollout memory is released; serving is refused
    with pytest.raises(ray.exceptions.RayTaskError, match="asleep"):
        rt.rollout(1)
    rt.engine.wake()


def kill_first_worker(pool) -> None:
    """Kill worker 0 and wait until Ray reports it dead, so the next call meets a dead actor
    (a kill racing a fast task could otherwise land after the task finished)."""
    handle = pool.handles[0]
    ray.kill(handle)  # asynchronous: the actor may still answer a call or two
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    pytest.fail("worker 0 still answers 60 s after ray.kill")


def test_killed_rollout_worker_is_restarted_and_resubmitted(session):
    rt = session["rt"]
    ref = rt.rollout(2)
    before = rt.engine.pool.restarts
    rt.engine.pool.before_submit = kill_first_worker
    b = rt.rollout(2)
    assert rt.engine.pool.restarts == before + 1
    assert len(b.trajectories) == len(ref.trajectories) == 8
    assert [t.request_id for t in b.trajectories] == [t.request_id for t in ref.trajectories]
    assert {t.version for t in b.trajectories} == {rt.version}  # restarted at the current version
    for x, y in zip(b.trajectories, ref.trajectories):
        torch.testing.assert_close(x.latents, y.latents, atol=1e-5, rtol=0)


def test_killed_reward_worker_is_restarted_and_resubmitted(session):
    rt = session["rt"]
    b = rt.rollout(3)
    rt.score(b, 3)
    ref = b.rewards.copy()
    before = rt.reward.pool.restarts
    rt.reward.pool.before_submit = kill_first_worker
    rt.score(b, 3)
    assert rt.reward.pool.restarts == before + 1
    assert len(b.rewards) == 8
    np.testing.assert_allclose(b.rewards, ref)


def test_train_step_logs_like_local(session, tmp_path):
    rt = session["rt"]
    logger = MetricsLogger(tmp_path)
    row = rt.train_step(3, logger)
    logger.close()
    assert row["rollout/rows"] == 8 and row["weights/version"] == 4
    assert np.isfinite(row["loss"]) and "timing/update_s" in row
    assert (session["rt"].run_dir / "checkpoint").exists()  # last step saves


def test_pool_sizes_and_errors(tmp_path):
    r = recipe_from_dict(tiny_recipe(tmp_path, backend="ray", num_workers=3))
    assert pool_sizes(r)["actor"]["workers"] == 3 and pool_sizes(r)["reward"]["workers"] == 1
    d = tiny_recipe(
        tmp_path,
        backend="ray",
        gpus_per_node=1,
        resource_pools={"actor": {"workers": 2, "gpus_per_worker": 1}},
    )
    with pytest.raises(TrainError, match=r"trainer\.resource_pools"):
        pool_sizes(recipe_from_dict(d))
    with pytest.raises(RecipeError, match="resource_pools"):
        recipe_from_dict(tiny_recipe(tmp_path, resource_pools={"critic": {"workers": 1}}))
    with pytest.raises(TrainError, match=r"trainer\.num_workers"):
        make_shard_plan([torch.arange(8)], 4, 3)
