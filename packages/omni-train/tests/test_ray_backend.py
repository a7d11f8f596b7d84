"""trainer.backend: ray on CPU: 2 FSDP2 actor ranks on gloo, 2 rollout workers, 1 reward.

The update on the Ray ranks is the local update (`omni_train.updates.run_update`) with an
all-reducing collective, so for every algorithm one update on the same batch gives the same
new weights on both backends. Worker start-up dominates the time: one actor pool per model
serves every algorithm (`RayLearner.configure`). The tests of the thinker's pool and of the
rollout and reward pools are `slow` (each pool starts in 10-17 s): `nox -s standalone` runs the
sd3 actor pool's tests against the wheels, `nox -s tests` runs them all.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from omni_adapters import weights_checksum  # noqa: E402
from omni_train.algorithms import ALGORITHMS  # noqa: E402
from omni_train.backends.local import LocalLearner  # noqa: E402
from omni_train.backends.ray import (  # noqa: E402
    RayDiffusionRollout,
    RayLearner,
    RayReward,
    pool_sizes,
)
from omni_train.errors import TrainError  # noqa: E402
from omni_train.loops import DiffusionLoop  # noqa: E402
from omni_train.models import load_policy  # noqa: E402
from omni_train.ports import Ports  # noqa: E402
from omni_train.recipe import RecipeError, recipe_from_dict  # noqa: E402
from omni_train.rewards import build_reward  # noqa: E402


def tiny_recipe(tmp, model, **sections) -> dict:
    d = {
        "experiment": "ray",
        "model": {"path": str(model), "tiny": "sd3"},
        "data": {
            "prompts": ["a red square", "a blue circle", "a green ring"],
            "prompts_per_step": 3,
        },
        "rollout": {
            "n": 4,
            "height": 32,
            "width": 32,
            "num_steps": 4,
            "sde_window_size": 2,
            "sde_window_range": [0, 3],
            "noise_level": 0.8,
        },
        "reward": {"name": "brightness"},
        # 12 rows, 2 minibatches of 6: 3 rows per rank, micro-batches of 2 + 1
        "algorithm": {
            "name": "flow_grpo",
            "clip_range": 0.2,
            "num_minibatches": 2,
            "rows_per_forward": 2,
        },
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
            "num_workers": 2,
        },
    }
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return d


#: per algorithm: the recipe changes that exercise its inputs (KL terms included)
ALGO_SECTIONS = {
    "flow_grpo": {"algorithm": {"kl_beta": 0.1}},
    "dance_grpo": {"algorithm": {"kl_beta": 0.1}, "rollout": {"sde_kind": "dance"}},
    "mix_grpo": {"algorithm": {"kl_beta": 0.1, "mix_window": {"ode_stride": 2}}},
    "flow_dppo": {"algorithm": {"kl_beta": 0.1}},
    "grpo_guard": {"algorithm": {"kl_beta": 0.1}},
    "diffusion_nft": {
        "algorithm": {
            "options": {"kl_weight": 0.1},
            "train_timesteps": 2,
            "timestep_sampling": "schedule",
        }
    },
    # two pairs a prompt group of 4: 6 pairs, split over the two ranks
    "diffusion_dpo": {"algorithm": {"train_timesteps": 2, "pairs_per_group": 2}},
    "gspo": {"algorithm": {"kl_beta": 0.1}},
    "grpo": {"algorithm": {"kl_beta": 0.1}},
}


def _recipe_for(name: str, base: dict) -> dict:
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for section, changes in ALGO_SECTIONS[name].items():
        d[section] = {**d.get(section, {}), **changes}
    d["algorithm"]["name"] = name
    if "clip_range" not in ALGORITHMS[name].loss_inputs:  # no ratio clip: the key is refused
        d["algorithm"] = {k: v for k, v in d["algorithm"].items() if k != "clip_range"}
    return d


@pytest.fixture(scope="module")
def sd3_pool(ray_session, tmp_path_factory, tiny_sd3):
    """A local engine + reward to make batches, and one 2-rank actor pool for sd3."""
    tmp = tmp_path_factory.mktemp("ray")
    base = tiny_recipe(tmp, tiny_sd3, trainer={"backend": "ray"})
    recipe = recipe_from_dict(base)
    learner = RayLearner(recipe, pool_sizes(recipe)["actor"])
    yield {"tmp": tmp, "base": base, "ray": learner}
    learner.close()


def _local_learner_and_batch(d: dict, tmp: Path) -> tuple[LocalLearner, Any, dict]:
    """A local learner for recipe dict ``d``, its step-0 batch and its initial trainables."""
    from diffusion_rollout import EmbeddedEngine

    local_recipe = recipe_from_dict({**d, "trainer": {**d["trainer"], "backend": "local"}})
    adapter = load_policy(local_recipe)
    local = LocalLearner(local_recipe, adapter)
    init, _ = local.state()
    init = {k: v.clone() for k, v in init.items()}
    engine = EmbeddedEngine(adapter, max_num_seqs=16)
    reward = build_reward(local_recipe)
    ports = Ports(local, engine, lambda: reward)
    loop = DiffusionLoop(local_recipe, ports, tmp)
    trajs = engine.generate_many(loop.requests_for(0))
    rewards, _, _ = loop.score(trajs, 0)
    batch, _ = loop.update_batch(trajs, rewards, 0)
    engine.close()
    return local, batch, init


@pytest.mark.parametrize("name", [n for n, a in ALGORITHMS.items() if a.model == "diffusion"])
def test_update_parity_local_vs_two_fsdp_ranks(name, sd3_pool):
    """One update on the same batch: the same LoRA weights, loss and metrics on both backends."""
    d = _recipe_for(name, sd3_pool["base"])
    ray_recipe = recipe_from_dict(d)
    local, batch, init = _local_learner_and_batch(d, sd3_pool["tmp"] / name)
    if hasattr(batch, "log_probs"):  # ratios away from 1 from the first minibatch on
        z = torch.randn(batch.log_probs.shape, generator=torch.Generator().manual_seed(0))
        batch = dataclasses.replace(batch, log_probs=batch.log_probs + 0.05 * z)
    before = {k: v.clone() for k, v in local.rollout_weights().items()}

    rl = sd3_pool["ray"]
    rl.configure(ray_recipe)  # fresh optimizer, this algorithm
    rl.load_state(init, None)
    got = rl.update(batch, 0)
    want = local.update(batch, 0)
    # DPO's loss multiplies each pair's error differences by beta / 2 = 1000: the second
    # minibatch, run on weights that differ by reduction-order rounding, reads 2e-5 to 4e-5
    # apart and its weights 1e-6 (above 1e-5 once, in CI's wheel install; they move 2e-2),
    # so DPO is held to 5e-4 and 1e-4, still far below what a wrong pairing or shard gives
    dpo = name == "diffusion_dpo"
    assert got["loss"] == pytest.approx(want["loss"], abs=5e-4 if dpo else 1e-5)
    assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-4, abs=1e-7)
    # every other metric is the minibatch's on both (the ratio's std too: one rank's rows in
    # one-row micro-batches here, in two-row ones on the local learner)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if not k.startswith(("perf/", "timing/", "loss", "actor/grad_norm")):
            assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-4 if dpo else 1e-6), k
    lw, rw = local.rollout_weights(), rl.rollout_weights().whole()
    assert sorted(lw) == sorted(rw)
    moved = max(float((lw[k] - before[k]).abs().max()) for k in lw)
    assert moved > 1e-4, "the update did not move the weights"
    for k in lw:
        torch.testing.assert_close(rw[k], lw[k], atol=1e-4 if dpo else 1e-5, rtol=0, msg=k)
    if name == "diffusion_dpo":  # the loop paired two per group before either backend ran
        assert batch.x0_w.shape[0] == 6
    if name == "diffusion_nft":  # both re-noised at the schedule's sigmas, not the raw draws
        assert got["actor/t_mean"] == pytest.approx(want["actor/t_mean"], abs=1e-6)
        assert abs(want["actor/t_mean"] - float(batch.t.mean())) > 1e-3
    if name in ("flow_grpo", "flow_dppo", "grpo_guard", "dance_grpo", "mix_grpo"):
        assert want["actor/kl_ref"] >= 0.0 and got["actor/kl_ref"] == pytest.approx(
            want["actor/kl_ref"], abs=1e-6
        )


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_rollout_correction_parity_local_vs_two_fsdp_ranks(mode, sd3_pool):
    """`algorithm.rollout_correction` on two FSDP ranks: each rank weights and rejects its own
    rows, and the correction's metrics are the whole batch's (means, the largest difference,
    the correlation), as on one process. Rows 0, 1 and 7 read a rollout log-prob off by +2
    (importance ratio e^-2: rejected), on both ranks' halves; row 7's step 1 by +3."""
    d = _recipe_for("flow_grpo", sd3_pool["base"])
    d["algorithm"]["rollout_correction"] = mode
    local, batch, init = _local_learner_and_batch(d, sd3_pool["tmp"] / f"correction-{mode}")
    lp = batch.log_probs.clone()
    lp[[0, 1, 7]] += 2.0
    lp[7, 1] += 1.0
    batch = dataclasses.replace(batch, log_probs=lp)
    rl = sd3_pool["ray"]
    rl.configure(recipe_from_dict(d))
    rl.load_state(init, None)
    got, want = rl.update(batch, 0, mode), local.update(batch, 0, mode)
    keys = sorted(k for k in want if k.startswith("correction/"))
    assert len(keys) >= 8 and sorted(k for k in got if k.startswith("correction/")) == keys
    assert want["correction/rejected_frac"] == pytest.approx(3 / 12, abs=1e-6)
    assert want["correction/logprob_abs_diff_max"] == pytest.approx(3.0, abs=1e-3)
    for k in keys:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    lw, rw = local.rollout_weights(), rl.rollout_weights().whole()
    for k in lw:
        torch.testing.assert_close(rw[k], lw[k], atol=1e-5, rtol=0, msg=k)


def test_auto_rows_per_forward_plans_from_the_ranks_measure(sd3_pool):
    """`rows_per_forward: auto` on two FSDP ranks: the first update at max_num_seqs, then the
    least of the ranks' measures for every rank; the same losses as the local learner."""
    d = _recipe_for("flow_grpo", sd3_pool["base"])
    d["algorithm"]["rows_per_forward"] = "auto"
    local, batch, init = _local_learner_and_batch(d, sd3_pool["tmp"] / "auto")
    rl = sd3_pool["ray"]
    rl.configure(recipe_from_dict(d))
    rl.load_state(init, None)
    assert rl.rows_fit is None
    for step in (0, 1):
        got, want = rl.update(batch, step), local.update(batch, step)
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
        assert got["perf/rows_fit"] == rl.rows_fit >= batch.log_probs.numel()
    rl.configure(recipe_from_dict(sd3_pool["base"]))  # back to the default for the others
    assert rl.rows_fit is None


def _thinker_recipe(tmp, model) -> dict:
    return {
        "experiment": "ray-omni",
        "model": {"path": str(model), "tiny": "qwen3_omni_thinker"},
        "lora": {"rank": 4, "alpha": 8},
        "data": {
            "task": "shapes",
            "task_options": {"image_size": 32},
            "task_size": 16,
            "val_size": 4,
            "prompts_per_step": 3,
        },
        "rollout": {"n": 4, "max_new_tokens": 3, "max_num_seqs": 8},
        "reward": {"name": "choice", "options": {"letters": "ABCD"}, "extract": "first_letter"},
        "algorithm": {"name": "gspo", "num_minibatches": 2, "rows_per_forward": 2},
        "optimizer": {"lr": 1e-2, "eps": 1e-4},
        "trainer": {
            "steps": 2,
            "output_dir": str(tmp / "run"),
            "progress": False,
            "threads": 1,
            "num_workers": 2,
            "backend": "ray",
        },
    }


@pytest.fixture(scope="module")
def thinker_pool(ray_session, tmp_path_factory, tiny_thinker):
    tmp = tmp_path_factory.mktemp("ray-omni")
    base = _thinker_recipe(tmp, tiny_thinker)
    recipe = recipe_from_dict(base)
    learner = RayLearner(recipe, pool_sizes(recipe)["actor"])
    yield {"tmp": tmp, "base": base, "ray": learner}
    learner.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gspo", "grpo"])
def test_token_update_parity_local_vs_two_fsdp_ranks(name, thinker_pool):
    from omni_train.backends.local import ThinkerRollout
    from omni_train.loops import OmniLoop
    from omni_train.updates import token_batch

    tmp = thinker_pool["tmp"]
    d = _recipe_for(name, thinker_pool["base"])
    ray_recipe = recipe_from_dict(d)
    local_recipe = recipe_from_dict({**d, "trainer": {**d["trainer"], "backend": "local"}})
    adapter = load_policy(local_recipe)
    local = LocalLearner(local_recipe, adapter)
    init, _ = local.state()
    init = {k: v.clone() for k, v in init.items()}
    before = {k: v.clone() for k, v in local.rollout_weights().items()}
    sampler = ThinkerRollout(adapter, local_recipe, None)
    reward = build_reward(local_recipe)
    loop = OmniLoop(local_recipe, Ports(local, sampler, lambda: reward), tmp / name)
    items = [it for it in loop.data.prompts_for_step(0) for _ in range(4)]
    out = sampler.generate(items, list(range(len(items))), temperature=1.0, top_p=1.0)
    adv = torch.linspace(-1.5, 1.5, len(items))  # any advantages: parity, not learning
    batch = token_batch(
        items, out["tokens"], out["log_probs"], out["mask"], adv, out["temperature"]
    )
    rl = thinker_pool["ray"]
    rl.configure(ray_recipe)
    rl.load_state(init, None)
    got = rl.update(batch, 0)
    want = local.update(batch, 0)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert got["actor/kl_ref"] == pytest.approx(want["actor/kl_ref"], abs=1e-6)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if not k.startswith(("perf/", "timing/", "loss", "actor/grad_norm")):
            assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    lw, rw = local.rollout_weights(), rl.rollout_weights().whole()
    for k in lw:
        torch.testing.assert_close(rw[k], lw[k], atol=1e-5, rtol=0, msg=k)
    assert max(float((lw[k] - before[k]).abs().max()) for k in lw) > 1e-4


@pytest.fixture(scope="module")
def pools(sd3_pool):
    """2 rollout workers and 1 reward worker on the sd3 recipe."""
    recipe = recipe_from_dict(sd3_pool["base"])
    sizes = pool_sizes(recipe)
    rj = recipe.model_dump_json()
    rollout = RayDiffusionRollout(rj, sizes["rollout"], 3)
    reward = RayReward(rj, sizes["reward"], 3)
    yield {"recipe": recipe, "rollout": rollout, "reward": reward}
    rollout.close()
    reward.close()


def _loop(recipe, rollout, reward, tmp):
    from omni_train.ports import Ports

    return DiffusionLoop(recipe, Ports(None, rollout, lambda: reward), tmp)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, a in ALGORITHMS.items() if a.model == "diffusion"])
def test_rollout_seeds_and_rewards_independent_of_split(name, pools, sd3_pool):
    """Each algorithm's own rollout requests (DanceGRPO's SDE, MixGRPO's window and ODE
    stride, the ODE rollouts of DiffusionNFT and DPO...) give the same trajectories and rewards
    on the two Ray rollout workers as on one embedded engine."""
    from diffusion_rollout import EmbeddedEngine

    recipe = recipe_from_dict(_recipe_for(name, sd3_pool["base"]))
    loop = _loop(recipe, pools["rollout"], pools["reward"], sd3_pool["tmp"] / f"split-{name}")
    reqs = loop.requests_for(1)
    got = pools["rollout"].generate_many(reqs)
    with EmbeddedEngine(load_policy(recipe), max_num_seqs=16) as engine:
        want = engine.generate_many(reqs)
    assert [t.request_id for t in got] == [r.request_id for r in reqs]
    for a, b in zip(want, got):
        assert a.window == b.window and a.seed == b.seed and a.params == b.params
        torch.testing.assert_close(b.latents, a.latents, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.final_latent, a.final_latent, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.log_probs, a.log_probs, atol=1e-4, rtol=0)
    ours, _, _ = loop.score(got, 0)
    local_reward = build_reward(recipe)
    np.testing.assert_allclose(
        ours, _loop(recipe, None, local_reward, sd3_pool["tmp"]).score(want, 0)[0], atol=1e-5
    )


@pytest.mark.slow
def test_weight_sync_is_rank_local_and_versioned(pools, sd3_pool):
    """The FSDP ranks' own LoRA pieces go to the rollout workers as object refs (the driver
    holds no weights); each worker puts them together and loads one whole version."""
    from omni_train.backends.ray import ShardedWeights

    rollout = pools["rollout"]
    weights = sd3_pool["ray"].rollout_weights()
    assert isinstance(weights, ShardedWeights) and len(weights.refs) == 2
    from diffusion_rollout.wire import tensors_from_bytes

    numels = [
        sum(t.numel() for t in tensors_from_bytes(ray.get(r))[0].values()) for r in weights.refs
    ]
    assert all(n < 0.75 * sum(numels) for n in numels), numels  # halves, not copies
    rollout.update_weights(weights, 7)
    want = weights_checksum(weights.whole())
    got = ray.get([h.checksum.remote() for h in rollout.pool.handles])
    assert got == [want, want]
    loop = _loop(pools["recipe"], rollout, pools["reward"], sd3_pool["tmp"] / "sync")
    assert {t.version for t in rollout.generate_many(loop.requests_for(1))} == {7}
    rollout.sleep()  # between phases the rollout memory is released; serving is refused
    with pytest.raises(ray.exceptions.RayTaskError, match="asleep"):
        rollout.generate_many(loop.requests_for(1))
    rollout.wake()


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


@pytest.mark.slow
def test_killed_rollout_worker_is_restarted_and_resubmitted(pools, sd3_pool):
    rollout = pools["rollout"]
    loop = _loop(pools["recipe"], rollout, pools["reward"], sd3_pool["tmp"] / "kill")
    reqs = loop.requests_for(2)
    ref = rollout.generate_many(reqs)
    before = rollout.pool.restarts
    rollout.pool.before_submit = kill_first_worker
    got = rollout.generate_many(reqs)
    assert rollout.pool.restarts == before + 1
    assert [t.request_id for t in got] == [t.request_id for t in ref]
    assert {t.version for t in got} == {rollout.version}  # restarted at the current version
    for x, y in zip(got, ref):
        torch.testing.assert_close(x.latents, y.latents, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_killed_reward_worker_is_restarted_and_resubmitted(pools, sd3_pool):
    rollout, reward = pools["rollout"], pools["reward"]
    loop = _loop(pools["recipe"], rollout, reward, sd3_pool["tmp"] / "kill-r")
    trajs = rollout.generate_many(loop.requests_for(3))
    ref, _, _ = loop.score(trajs, 3)
    before = reward.pool.restarts
    reward.pool.before_submit = kill_first_worker
    got, _, _ = loop.score(trajs, 3)
    assert reward.pool.restarts == before + 1
    np.testing.assert_allclose(got, ref)


@pytest.mark.slow
def test_workers_run_at_the_drivers_priority(pools, sd3_pool):
    """Ray's default worker niceness is 15, at which any other process on the machine would
    starve the ranks, the rollout and the reward workers (`WORKER_RUNTIME_ENV`)."""
    import ray

    def niceness(_actor):
        return os.nice(0)

    # run in file order, one rollout and one reward worker are restarted ones by now
    actors = [
        *sd3_pool["ray"].actors,
        *pools["rollout"].pool.handles,
        *pools["reward"].pool.handles,
    ]
    assert len(actors) == 5
    assert ray.get([a.__ray_call__.remote(niceness) for a in actors]) == [os.nice(0)] * len(actors)


# A driver that joins a running cluster (RAY_ADDRESS), as `omni-train` does there: its job's
# workers run at its priority too
_JOIN_AND_ASK = """
import json, os, sys
import ray
from omni_train.backends.ray import ensure_ray
from omni_train.recipe import recipe_from_dict
assert ensure_ray(recipe_from_dict(json.loads(sys.argv[1])))
print("niceness", ray.get(ray.remote(lambda: os.nice(0)).remote()))
"""


def test_a_driver_joining_a_cluster_runs_its_workers_at_its_priority(
    ray_session, tmp_path, tiny_sd3
):
    import json
    import subprocess
    import sys

    recipe = tiny_recipe(tmp_path, tiny_sd3, trainer={"backend": "ray"})
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    out = subprocess.run(
        [sys.executable, "-c", _JOIN_AND_ASK, json.dumps(recipe)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"niceness {os.nice(0)}" in out.stdout.splitlines()


def test_pool_sizes_and_errors(tmp_path, tiny_sd3):
    r = recipe_from_dict(
        tiny_recipe(tmp_path, tiny_sd3, trainer={"backend": "ray", "num_workers": 3})
    )
    assert pool_sizes(r)["actor"]["workers"] == 3 and pool_sizes(r)["reward"]["workers"] == 1
    d = tiny_recipe(
        tmp_path,
        tiny_sd3,
        trainer={
            "backend": "ray",
            "gpus_per_node": 1,
            "resource_pools": {"actor": {"workers": 2, "gpus_per_worker": 1}},
        },
    )
    with pytest.raises(TrainError, match=r"trainer\.resource_pools"):
        pool_sizes(recipe_from_dict(d))
    with pytest.raises(RecipeError, match="resource_pools"):
        recipe_from_dict(
            tiny_recipe(tmp_path, tiny_sd3, trainer={"resource_pools": {"critic": {"workers": 1}}})
        )
    # a served rollout: no rollout pool, so its GPUs are not counted, and a pool for it is refused
    d["trainer"]["resource_pools"] = {"actor": {"workers": 1, "gpus_per_worker": 1}}
    d["rollout"] = {**d.get("rollout", {}), "backend": "http"}
    assert pool_sizes(recipe_from_dict(d))["rollout"]["workers"] == 0  # 1 GPU is enough
    d["trainer"]["resource_pools"]["rollout"] = {"workers": 1}
    with pytest.raises(RecipeError, match=r"trainer\.resource_pools\.rollout: with rollout"):
        recipe_from_dict(d)
