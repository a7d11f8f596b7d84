"""backend verl: config generation and our losses/advantages/rewards in verl's signatures.

The config and signature tests need no verl. The registry tests need verl itself (its own
environment, see docs/scaling.md) and are skipped only when verl cannot be imported; the full
run is a `gpu` test.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omni_train.backends import verl_backend as vb
from omni_train.recipe import RecipeError, recipe_from_dict

needs_verl = pytest.mark.skipif(
    not vb.verl_available(),
    reason="verl is not importable here: run in .venv-verl (docs/scaling.md)",
)


def omni_recipe(tmp, **over):
    d = {
        "experiment": "omni-gspo",
        "model": {"path": str(tmp / "thinker")},
        "lora": {"rank": 16, "alpha": 32},
        "data": {"prompts": ["1+1?", "2+2?", "3+3?", "4+4?"], "prompts_per_step": 4},
        "reward": {"name": "math"},
        "algorithm": {
            "name": "gspo",
            "clip_range": 0.2,
            "num_minibatches": 2,
            "epochs": 1,
            "options": {"clip_low": 3e-4, "clip_high": 4e-4},
        },
        "optimizer": {"lr": 1e-6},
        "rollout": {"n": 8},
        "trainer": {
            "backend": "verl",
            "steps": 7,
            "nnodes": 1,
            "gpus_per_node": 4,
            "output_dir": str(tmp / "run"),
            "verl": {
                "data.max_response_length": 512,
                "actor_rollout_ref.rollout.gpu_memory_utilization": 0.4,
            },
        },
    }
    for k, v in over.items():
        d[k] = {**d.get(k, {}), **v}
    return recipe_from_dict(d)


def test_config_from_recipe(tmp_path):
    cfg = vb.build_verl_config(omni_recipe(tmp_path))
    arr = cfg["actor_rollout_ref"]
    assert arr["actor"]["policy_loss"]["loss_mode"] == "omni_gspo"
    assert arr["actor"]["clip_ratio_low"] == 3e-4 and arr["actor"]["clip_ratio_high"] == 4e-4
    assert arr["actor"]["loss_agg_mode"] == "seq-mean-token-mean"
    assert arr["actor"]["strategy"] == "fsdp2" and arr["actor"]["optim"]["lr"] == 1e-6
    assert arr["actor"]["ppo_mini_batch_size"] == 2  # 4 prompts / 2 minibatches
    assert arr["model"]["lora_rank"] == 16 and arr["model"]["lora_alpha"] == 32
    assert arr["model"]["external_lib"] == "omni_train.backends.verl_register"
    assert arr["rollout"]["n"] == 8 and arr["rollout"]["gpu_memory_utilization"] == 0.4
    assert cfg["data"]["train_batch_size"] == 4 and cfg["data"]["max_response_length"] == 512
    assert cfg["algorithm"]["adv_estimator"] == "omni_group"
    assert cfg["algorithm"]["norm_adv_by_std_in_grpo"] is True
    assert cfg["trainer"]["n_gpus_per_node"] == 4 and cfg["trainer"]["total_training_steps"] == 7
    assert cfg["custom_reward_function"]["name"] == "omni_compute_score"
    assert cfg["custom_reward_function"]["reward_kwargs"] == {"reward": "math", "options": {}}
    ov = vb.to_overrides(cfg)
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=omni_gspo" in ov
    assert "trainer.logger=[console]" in ov
    assert "custom_reward_function.reward_kwargs={reward:math,options:{}}" in ov
    assert f"custom_reward_function.path={vb.__file__}" in ov or any(
        o.startswith("custom_reward_function.path=") and o.endswith("verl_backend.py'") for o in ov
    )
    assert vb._hydra("it's a b") == "'it\\'s a b'" and vb._hydra([1, True, None]) == "[1,true,null]"
    assert len(ov) == len(set(o.split("=")[0] for o in ov))


def test_config_rejects_non_omni_losses(tmp_path):
    with pytest.raises(RecipeError, match=r"algorithm\.name"):
        vb.build_verl_config(omni_recipe(tmp_path, algorithm={"name": "flow_grpo"}))
    r = omni_recipe(tmp_path, algorithm={"name": "grpo", "options": {}})
    cfg = vb.build_verl_config(r)
    assert cfg["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"] == "omni_grpo"
    assert cfg["actor_rollout_ref"]["actor"]["loss_agg_mode"] == "token-mean"


def _batch(seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g)
    new = (old + 0.05 * torch.randn(B, T, generator=g)).requires_grad_(True)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = torch.ones(B, T)
    mask[0, 4:] = 0
    return old, new, adv, mask


@pytest.mark.parametrize("name,agg", [("gspo", "seq-mean-token-mean"), ("grpo", "token-mean")])
def test_verl_signature_calls_our_loss(name, agg):
    from omni_algos.losses import LOSSES

    old, new, adv, mask = _batch()
    conf = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.3)
    loss, metrics = vb.verl_policy_loss(name)(old, new, adv, mask, agg, conf)
    kw = {"clip_low": 0.1, "clip_high": 0.3, "agg": agg}
    if name == "grpo":
        kw["clip_ratio_c"] = 3.0
    ref = LOSSES[name](new, old, adv, mask, **kw)
    torch.testing.assert_close(loss, ref.loss)
    (g1,) = torch.autograd.grad(loss, new)
    (g2,) = torch.autograd.grad(ref.loss, new)
    torch.testing.assert_close(g1, g2)
    assert {"actor/pg_clipfrac", "actor/ppo_kl"} <= set(metrics)
    w = torch.full_like(new, 2.0)
    loss2, _ = vb.verl_policy_loss(name)(old, new, adv, mask, agg, conf, rollout_is_weights=w)
    torch.testing.assert_close(loss2, 2 * loss)


def test_advantage_estimator_is_group_relative():
    from omni_algos.advantages import group_advantages

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.1])
    tok = torch.zeros(6, 5)
    tok[:, -1] = rewards
    mask = torch.ones(6, 5)
    mask[1, 3:] = 0
    index = ["a", "a", "a", "b", "b", "b"]
    adv, ret = vb.omni_group_advantage(tok, mask, index)
    want = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), std="group", eps=1e-6)
    torch.testing.assert_close(adv[:, 0], want)
    assert float(adv[1, 4]) == 0.0 and torch.equal(adv, ret)
    adv_nostd, _ = vb.omni_group_advantage(tok, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv_nostd[:3, 0], rewards[:3] - rewards[:3].mean())


def test_compute_score_uses_our_reward():
    right = vb.omni_compute_score("omni", "so \\boxed{4}", "4", reward="math")
    wrong = vb.omni_compute_score("omni", "so \\boxed{5}", "4", reward="math")
    assert right > wrong


def test_run_without_verl_says_how(tmp_path, monkeypatch):
    from omni_train import train
    from omni_train.errors import TrainError

    monkeypatch.setattr(vb, "verl_available", lambda: False)
    with pytest.raises(TrainError, match=r"\.venv-verl"):
        train(omni_recipe(tmp_path))  # omni recipe + backend verl dispatches to run_verl


@needs_verl
def test_registered_in_verl_registries():
    from verl.trainer.ppo import core_algos

    done = vb.register_into_verl()
    assert set(done["policy_loss"]) == {"omni_gspo", "omni_grpo"}
    old, new, adv, mask = _batch(1)
    conf = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.3)
    fn = core_algos.get_policy_loss_fn("omni_gspo")
    loss, _ = fn(
        old_log_prob=old,
        log_prob=new,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="seq-mean-token-mean",
        config=conf,
    )
    from omni_algos.losses import gspo

    torch.testing.assert_close(loss, gspo(new, old, adv, mask, clip_low=0.1, clip_high=0.3).loss)
    est = core_algos.get_adv_estimator_fn("omni_group")
    assert est is vb.omni_group_advantage
    vb.register_into_verl()  # idempotent


@needs_verl
def test_registration_module_for_verl_workers():
    import importlib

    mod = importlib.import_module("omni_train.backends.verl_register")
    assert "omni_group" in mod.REGISTERED["adv_estimator"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_verl
def test_full_verl_run_on_tiny_thinker(tmp_path):
    r = omni_recipe(
        tmp_path,
        model={"path": str(tmp_path / "thinker"), "tiny": "qwen3_omni_thinker"},
        trainer={
            "steps": 1,
            "gpus_per_node": 1,
            "verl": {"data.max_response_length": 32, "data.max_prompt_length": 64},
        },
    )
    vb.run_verl(r, tmp_path / "run")
    assert (tmp_path / "run" / "verl_config.json").is_file()
