"""backend verl: config generation and our losses/advantages/rewards in verl's signatures.

The config and signature tests need no verl. The rest needs verl itself and runs in the lock's
verl environment (`nox -s tests-verl`): verl's own `ppo_trainer.yaml` composed with every
override we generate and checked by verl's `validate_config`, the reward function verl loads,
verl's registries, and verl's `RLHFDataset` reading the parquet we write (images included).
They are skipped only where verl cannot be imported; the full run is a `gpu` test.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from omni_algos.losses.token import AGG_MODES
from omni_train.backends import verl_backend as vb
from omni_train.recipe import RecipeError, recipe_from_dict

needs_verl = pytest.mark.skipif(
    not vb.verl_available(),
    reason="verl is not importable here: run `uv run nox -s tests-verl` (docs/scaling.md)",
)


def omni_recipe(tmp, **over):
    d = {
        "experiment": "omni-gspo",
        "model": {"path": str(tmp / "thinker")},
        "lora": {"rank": 16, "alpha": 32},
        "data": {
            "task": "shapes",
            "task_options": {"image_size": 32},
            "task_size": 8,
            "val_size": 4,
            "prompts_per_step": 4,
        },
        "reward": {"name": "choice", "options": {"letters": "ABCD"}, "extract": "first_letter"},
        "algorithm": {
            "name": "gspo",
            "clip_range": 0.2,
            "num_minibatches": 2,
            "epochs": 1,
            "options": {"clip_low": 3e-4, "clip_high": 4e-4},
        },
        "optimizer": {"lr": 1e-6},
        "rollout": {"n": 8, "max_new_tokens": 16, "temperature": 0.9, "val_temperature": 0.0},
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


def test_grpos_dual_clip_goes_to_verl_or_is_refused(tmp_path):
    """`algorithm.options.clip_ratio_c` reaches verl's actor; null (no dual clip), which
    verl's actor cannot do, is refused by key."""
    algo = {"name": "grpo", "clip_range": None, "options": {"clip_ratio_c": 5.0}}
    actor = vb.build_verl_config(omni_recipe(tmp_path, algorithm=algo))["actor_rollout_ref"]
    assert actor["actor"]["clip_ratio_c"] == 5.0
    algo["options"] = {"clip_ratio_c": None}
    with pytest.raises(RecipeError, match=re.escape("algorithm.options.clip_ratio_c: null")):
        omni_recipe(tmp_path, algorithm=algo)


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
    assert arr["rollout"]["temperature"] == 0.9
    assert arr["rollout"]["val_kwargs"] == {"temperature": 0.0, "top_p": 1.0, "do_sample": False}
    assert cfg["data"]["train_batch_size"] == 4 and cfg["data"]["max_response_length"] == 512
    assert cfg["data"]["image_key"] == "images"
    assert cfg["algorithm"]["adv_estimator"] == "omni_group"
    assert cfg["algorithm"]["norm_adv_by_std_in_grpo"] is True
    assert cfg["trainer"]["n_gpus_per_node"] == 4 and cfg["trainer"]["total_training_steps"] == 7
    # logging, checkpoints and resuming as the recipe says, not verl's defaults
    assert cfg["trainer"]["logger"] == ["console"] and cfg["trainer"]["project_name"] == "omni-rl"
    assert cfg["trainer"]["resume_mode"] == "auto"  # the same command continues the run
    assert cfg["trainer"]["max_actor_ckpt_to_keep"] == 2
    other = vb.build_verl_config(
        omni_recipe(
            tmp_path,
            trainer={
                "overwrite": True,
                "report_to": ["tensorboard", "wandb"],
                "wandb_project": "p",
                "keep_checkpoints": 5,
            },
        )
    )
    assert other["trainer"]["resume_mode"] == "disable"
    assert other["trainer"]["logger"] == ["console", "tensorboard", "wandb"]
    assert other["trainer"]["project_name"] == "p"
    assert other["trainer"]["max_actor_ckpt_to_keep"] == 5
    fn = cfg["reward"]["custom_reward_function"]
    assert fn["path"] == "pkg://omni_train.backends.verl_backend"
    assert fn["name"] == "omni_compute_score"
    assert fn["reward_kwargs"] == {
        "reward": "choice",
        "options": {"letters": "ABCD"},
        "extract": "first_letter",
    }
    assert "custom_reward_function" not in cfg and "reward_model" not in cfg  # verl 0.9: legacy
    ov = vb.to_overrides(cfg)
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=omni_gspo" in ov
    assert "trainer.logger=[console]" in ov
    assert (
        "++reward.custom_reward_function.reward_kwargs="
        "{reward:choice,options:{letters:ABCD},extract:first_letter}"
    ) in ov
    assert "reward.custom_reward_function.path='pkg://omni_train.backends.verl_backend'" in ov
    assert vb._hydra("it's a b") == "'it\\'s a b'" and vb._hydra([1, True, None]) == "[1,true,null]"
    assert len(ov) == len(set(o.split("=")[0] for o in ov))


def test_config_rejects_what_verl_cannot_run(tmp_path):
    # what verl cannot run stops at the recipe check, by key (the algorithm table)
    with pytest.raises(RecipeError, match=r"trainer\.backend: flow_grpo runs on local, ray"):
        vb.build_verl_config(
            omni_recipe(
                tmp_path,
                algorithm={"name": "flow_grpo"},
                data={"task": None, "prompts": ["a cat"]},
                reward={"name": "brightness", "options": {}, "extract": "response"},
            )
        )
    r = omni_recipe(tmp_path, algorithm={"name": "grpo", "options": {}})
    cfg = vb.build_verl_config(r)
    assert cfg["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"] == "omni_grpo"
    assert cfg["actor_rollout_ref"]["actor"]["loss_agg_mode"] == "token-mean"
    with pytest.raises(RecipeError, match=r"rollout\.allowed_tokens"):
        vb.build_verl_config(omni_recipe(tmp_path, rollout={"allowed_tokens": ["A", "B"]}))
    with pytest.raises(RecipeError, match=r"data\.prompts"):
        vb.build_verl_config(omni_recipe(tmp_path, data={"task": None, "prompts": ["1+1?"]}))


def test_items_from_task_and_jsonl(tmp_path):
    """The verl hand-off reads the omni loop's items: a generated task's train / held-out val
    splits, or a JSONL file with and without images."""
    from PIL import Image

    from omni_train.tasks import shapes_task

    train, val = vb.omni_items(omni_recipe(tmp_path))
    assert len(train) == 8 and len(val) == 4
    assert [it.answer for it in train] == [it.answer for it in shapes_task("train", 8, 0, 32)]
    assert all(it.image is not None and it.image.shape == (32, 32, 3) for it in train)
    Image.fromarray(train[0].image).save(tmp_path / "q0.png")
    (tmp_path / "qa.jsonl").write_text(
        '{"prompt": "What is 2+2?", "answer": "4"}\n'
        '{"prompt": "How many shapes?", "answer": "B", "image": "q0.png"}\n'
    )
    r = omni_recipe(tmp_path, data={"task": None, "file": str(tmp_path / "qa.jsonl")})
    rows, val_rows = vb.omni_items(r)
    assert [it.answer for it in rows] == ["4", "B"] and rows[0].image is None
    assert (rows[1].image == train[0].image).all() and len(val_rows) == 2


def test_compute_score_extracts_the_choice_letter():
    kw = {"reward": "choice", "options": {"letters": "ABCD"}}
    assert vb.omni_compute_score("omni", "(B) two shapes", "B", extract="first_letter", **kw) == 1
    assert vb.omni_compute_score("omni", "Bob says C", "B", extract="first_letter", **kw) == 0
    with pytest.raises(ValueError, match="extract"):
        vb.omni_compute_score("omni", "B", "B", extract="last", **kw)


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
    # verl hands an estimator it does not know the algorithm config, not the keyword
    algorithm = {"norm_adv_by_std_in_grpo": False}
    adv_config, _ = vb.omni_group_advantage(tok, mask, index, config=algorithm)
    torch.testing.assert_close(adv_config, adv_nostd)
    # and `adv_clip_max` (ours) there: clipped as the local loops clip (+-1.0 -> +-0.5 here)
    clipped, _ = vb.omni_group_advantage(tok, mask, index, config={"adv_clip_max": 0.5})
    assert float(want.abs().max()) > 0.5
    torch.testing.assert_close(clipped[:, 0], want.clamp(-0.5, 0.5))


def test_adv_std_global_is_refused_on_verl(tmp_path):
    with pytest.raises(RecipeError, match=r"algorithm\.adv_std"):
        omni_recipe(tmp_path, algorithm={"adv_std": "global"})
    cfg = vb.build_verl_config(omni_recipe(tmp_path, algorithm={"adv_std": "none"}))
    assert cfg["algorithm"]["norm_adv_by_std_in_grpo"] is False


@pytest.mark.parametrize(
    "over,key",
    [
        ({"algorithm": {"rows_per_forward": 4}}, "algorithm.rows_per_forward"),
        ({"optimizer": {"scheduler": {"name": "cosine"}}}, "optimizer.scheduler"),
        ({"optimizer": {"scheduler": {"warmup_steps": 10}}}, "optimizer.scheduler"),
        ({"optimizer": {"eps": 1e-6}}, "optimizer.eps"),
        ({"lora": {"enabled": False, "full_regex": ".*q_proj.*"}}, "lora.full_regex"),
        (
            {"reward": {"name": None, "terms": [{"name": "math", "weight": 1.0}]}},
            "reward.terms",
        ),
        ({"data": {"task": None, "prompts": ["2+2?"]}}, "data.prompts"),
        ({"lora": {"dropout": 0.1}}, "lora.dropout"),
        ({"lora": {"init_seed": 3}}, "lora.init_seed"),
    ],
)
def test_what_verl_is_not_handed_is_refused_when_the_recipe_is_built(tmp_path, over, key):
    """Settings build_verl_config has no verl key for are refused by name at load time
    (and so by `omni-train validate`), not ignored or refused only when the run starts."""
    with pytest.raises(RecipeError, match=re.escape(key)):
        omni_recipe(tmp_path, **over)


def _micro_batches(seed=2, B=8, T=6):
    """A mini-batch of B responses split into micro-batches of 3, 1 and 4 rows, a response
    fully masked, the rest of uneven lengths."""
    old, new, adv, mask = _batch(seed, B, T)
    mask[2] = 0
    mask[5, 2:] = 0
    return old, new, adv, mask, [slice(0, 3), slice(3, 4), slice(4, 8)]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("dp_size", [1, 2])
def test_micro_batch_losses_add_up_to_the_global_batch_loss(agg, dp_size):
    """verl calls backward once per micro-batch with `global_batch_info` set; our loss, scaled
    by `global_batch_scale`, then sums over the micro-batches to the loss of the whole batch in
    one pass, value and gradient. With dp_size ranks each holding as many responses, each
    rank's sum is that loss, and so is FSDP's average of the ranks' gradients."""
    from omni_algos.losses import LOSSES

    old, new, adv, mask, parts = _micro_batches()
    info = {
        "dp_size": dp_size,
        "batch_num_tokens": float(mask.sum()) * dp_size,  # the other ranks hold as many
        "global_batch_size": int((mask.sum(-1) > 0).sum()) * dp_size,
        "loss_scale_factor": None,
    }
    conf = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.3)
    conf.global_batch_info = info
    loss_fn = vb.verl_policy_loss("grpo")
    total = sum(loss_fn(old[p], new[p], adv[p], mask[p], agg, conf)[0] for p in parts)
    whole = LOSSES["grpo"](new, old, adv, mask, clip_low=0.1, clip_high=0.3, agg=agg).loss
    torch.testing.assert_close(total, whole)
    (g_total,) = torch.autograd.grad(total, new)
    (g_whole,) = torch.autograd.grad(whole, new)
    torch.testing.assert_close(g_total, g_whole)


def test_compute_score_uses_our_reward():
    right = vb.omni_compute_score("omni", "so \\boxed{4}", "4", reward="math")
    wrong = vb.omni_compute_score("omni", "so \\boxed{5}", "4", reward="math")
    assert right > wrong


def test_verl_runs_its_ray_workers_at_the_drivers_priority(tmp_path):
    """The generated config hands verl our Ray runtime environment (workers at the driver's
    niceness, not Ray's 15), as a string: a bare `0` would reach verl as an int, which Ray
    refuses in `env_vars`."""
    from omni_train.backends.ray_runtime import WORKER_RUNTIME_ENV

    cfg = vb.build_verl_config(omni_recipe(tmp_path))
    assert cfg["ray_kwargs"]["ray_init"]["runtime_env"] == WORKER_RUNTIME_ENV
    assert "++ray_kwargs.ray_init.runtime_env.env_vars={RAY_worker_niceness:'0'}" in (
        vb.to_overrides(cfg)
    )
    strings = {"a": "0", "b": "1e-3", "c": "inf", "d": "False", "e": "fsdp2"}
    assert vb.to_overrides(strings) == ["a='0'", "b='1e-3'", "c='inf'", "d='False'", "e=fsdp2"]


def test_run_without_verl_says_how(tmp_path, monkeypatch):
    from omni_train import train
    from omni_train.errors import TrainError

    monkeypatch.setattr(vb, "verl_available", lambda: False)
    with pytest.raises(TrainError, match=r"\.venv-verl"):
        train(omni_recipe(tmp_path))  # omni recipe + backend verl dispatches to run_verl


def _compose(overrides):
    """verl's own `ppo_trainer` config (its installed YAMLs) with `overrides`, as
    `python -m verl.trainer.main_ppo` composes it."""
    from pathlib import Path

    import verl
    from hydra import compose, initialize_config_dir

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def _leaves(cfg, prefix=""):
    for k, v in cfg.items():
        key = prefix + k
        if isinstance(v, dict) and v and key not in vb.ADDED_KEYS:
            yield from _leaves(v, key + ".")
        else:
            yield key, v


@needs_verl
def test_verl_config_accepts_every_override(tmp_path):
    """verl's Hydra config takes every override we generate, each value lands on the key verl
    reads, verl's `validate_config` passes, and the reward function verl loads from the config
    is ours with our keyword arguments."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    r = omni_recipe(
        tmp_path,
        trainer={"gpus_per_node": 1, "report_to": ["tensorboard"], "overwrite": True},
        algorithm={"kl_beta": 0.01},
    )
    cfg = vb.build_verl_config(r)
    conf = _compose(vb.to_overrides(cfg))
    leaves = dict(_leaves(cfg))
    assert len(leaves) == len(vb.to_overrides(cfg))
    for key, want in leaves.items():
        got = OmegaConf.select(conf, key, throw_on_missing=True)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        assert got == want, key
    # validate_config's last check bounds the LoRA rank by vLLM's largest (512) and imports vllm
    # for it, which verl's CPU environment lacks: it runs on a copy without LoRA, the bound here.
    assert 0 < conf.actor_rollout_ref.model.lora_rank <= 512
    no_lora = OmegaConf.merge(conf, {"actor_rollout_ref": {"model": {"lora_rank": 0}}})
    validate_config(no_lora, use_reference_policy=need_reference_policy(conf), use_critic=False)
    assert need_reference_policy(conf) and not need_critic(conf)  # kl loss: ref policy, GRPO-style
    score = get_custom_reward_fn(conf)
    assert score("omni", "(B) two", "B", {"prompt": "How many?"}) == 1.0
    assert score("omni", "Bob: C", "B", {"prompt": "How many?"}) == 0.0


@needs_verl
def test_verl_starts_ray_with_our_runtime_environment(tmp_path, monkeypatch):
    """verl's own `main_ppo.run_ppo`, given the config composed from our overrides, calls
    `ray.init` with our worker variables merged onto verl's (stopped there: the rest needs
    GPUs)."""
    import inspect

    import ray
    import ray.runtime_env
    from verl.trainer import main_ppo

    class RayInitCalled(Exception):
        pass

    def record(*args, **kwargs):
        # the call must be one the real ray.init accepts, with a runtime env Ray accepts
        inspect.signature(ray.init).bind(*args, **kwargs)
        ray.runtime_env.RuntimeEnv(**kwargs["runtime_env"])
        raise RayInitCalled(kwargs)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", record)
    r = omni_recipe(tmp_path, trainer={"gpus_per_node": 1})
    conf = _compose(vb.to_overrides(vb.build_verl_config(r)))
    with pytest.raises(RayInitCalled) as called:
        main_ppo.run_ppo(conf, None)
    env_vars = called.value.args[0]["runtime_env"]["env_vars"]
    assert env_vars["RAY_worker_niceness"] == "0"
    assert "VERL_FULL_DETERMINISM" in env_vars  # verl's own variables are kept


@needs_verl
def test_verl_dataset_reads_our_parquet_with_images(tmp_path):
    """verl's RLHFDataset, given the exported tiny thinker's processor, reads the parquet we
    write: every row survives its length filter (the image is processed), and the chat message
    carries the image itself in front of the question."""
    import numpy as np
    from transformers import AutoProcessor
    from verl.utils.dataset.rl_dataset import RLHFDataset

    r = omni_recipe(
        tmp_path,
        model={"path": str(tmp_path / "thinker"), "tiny": "qwen3_omni_thinker"},
        trainer={"gpus_per_node": 1},
    )
    train, _ = vb.write_dataset(r, tmp_path / "verl_data")
    model = vb.export_thinker(r, tmp_path / "verl_model")
    processor = AutoProcessor.from_pretrained(model)
    conf = _compose(vb.to_overrides(vb.build_verl_config(r)))
    data_conf = conf.data
    data_conf.filter_overlong_prompts_workers = 1
    data_conf.filter_overlong_prompts = True
    ds = RLHFDataset(train, processor.tokenizer, data_conf, processor)
    items, _ = vb.omni_items(r)
    assert len(ds) == len(items) == 8
    (message,) = ds[3]["raw_prompt"]
    image_part, text_part = message["content"]
    assert image_part["type"] == "image" and text_part == {"type": "text", "text": items[3].prompt}
    assert np.array_equal(np.asarray(image_part["image"].convert("RGB")), items[3].image)
    assert ds[3]["reward_model"]["ground_truth"] == items[3].answer


@needs_verl
def test_registered_in_verl_registries():
    from verl.trainer.ppo import core_algos

    done = vb.register_into_verl()
    assert set(done["policy_loss"]) == {"omni_gspo", "omni_grpo"}
    assert done["adv_estimator"] == ["omni_group"]
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
@pytest.mark.parametrize(
    "adv_std,adv_clip_max", [("group", 5.0), ("none", 5.0), ("group", 0.5), ("none", 0.3)]
)
def test_verl_computes_our_advantage_with_the_recipes_std_setting(tmp_path, adv_std, adv_clip_max):
    """verl's own `compute_advantage`, called as its trainer calls it (with the algorithm
    config composed from our overrides), gives our group advantages with the recipe's
    `algorithm.adv_std`, clipped to its `adv_clip_max` as the local loops clip them."""
    import numpy as np
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from omni_algos.advantages import group_advantages

    vb.register_into_verl()
    r = omni_recipe(tmp_path, algorithm={"adv_std": adv_std, "adv_clip_max": adv_clip_max})
    algorithm = _compose(vb.to_overrides(vb.build_verl_config(r))).algorithm
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.1])
    tok = torch.zeros(6, 5)
    tok[:, -1] = rewards
    data = DataProto.from_dict(
        tensors={"token_level_rewards": tok, "response_mask": torch.ones(6, 5)},
        non_tensors={"uid": np.array(["a", "a", "a", "b", "b", "b"], dtype=object)},
    )
    out = compute_advantage(  # as verl.trainer.ppo.v1.trainer_base passes it
        data,
        adv_estimator=algorithm.adv_estimator,
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True),
        config=algorithm,
    )
    want = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), std=adv_std, eps=1e-6)
    assert (float(want.abs().max()) > adv_clip_max) == (adv_clip_max < 1.0)  # the clip binds
    torch.testing.assert_close(
        out.batch["advantages"][:, 0], want.clamp(-adv_clip_max, adv_clip_max)
    )


@needs_verl
@pytest.mark.parametrize(
    "name,verl_name,agg",
    [("grpo", "vanilla", agg) for agg in AGG_MODES] + [("gspo", "gspo", "seq-mean-token-mean")],
)
def test_our_loss_is_verls_own_on_its_global_batch(tmp_path, name, verl_name, agg):
    """On verl's real actor config (composed from our overrides), with `global_batch_info`
    filled as verl's `ppo_loss` fills it, our loss on each micro-batch equals verl's own
    (`vanilla`: its dual-clip PPO loss, GRPO's; `gspo`), value and gradient, and the
    micro-batches add up to the whole batch's."""
    from verl.trainer.ppo import core_algos
    from verl.utils.config import omega_conf_to_dataclass

    vb.register_into_verl()
    clips = {"grpo": (0.1, 0.3), "gspo": (3e-4, 4e-4)}[name]
    options = {"clip_low": clips[0], "clip_high": clips[1], "agg": agg}
    r = omni_recipe(tmp_path, algorithm={"name": name, "options": options})
    actor = omega_conf_to_dataclass(
        _compose(vb.to_overrides(vb.build_verl_config(r))).actor_rollout_ref.actor
    )
    assert actor.policy_loss.loss_mode == f"omni_{name}" and actor.loss_agg_mode == agg
    old, new, adv, mask, parts = _micro_batches(seed=4)
    mask = mask.bool()  # as verl's ppo_loss hands it over
    actor.global_batch_info.update(
        dp_size=1,
        batch_num_tokens=int(mask.sum()),
        global_batch_size=int((mask.sum(-1) > 0).sum()),
        loss_scale_factor=actor.loss_scale_factor,
    )
    ours_fn = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
    verl_fn = core_algos.get_policy_loss_fn(verl_name)
    total = 0
    for p in parts:
        kw = dict(old_log_prob=old[p], advantages=adv[p], response_mask=mask[p], config=actor)
        ours, _ = ours_fn(log_prob=new[p], loss_agg_mode=agg, **kw)
        theirs, _ = verl_fn(log_prob=new[p], loss_agg_mode=agg, **kw)
        torch.testing.assert_close(ours, theirs)
        (g_ours,) = torch.autograd.grad(ours, new)
        (g_theirs,) = torch.autograd.grad(theirs, new)
        torch.testing.assert_close(g_ours, g_theirs)
        total = total + ours
    actor.global_batch_info.clear()  # verl's loss on the whole batch in one pass
    kw = dict(old_log_prob=old, advantages=adv, response_mask=mask, config=actor)
    whole, _ = verl_fn(log_prob=new, loss_agg_mode=agg, **kw)
    torch.testing.assert_close(total, whole)


@needs_verl
def test_registration_module_for_verl_workers():
    import importlib

    mod = importlib.import_module("omni_train.backends.verl_register")
    assert "omni_group" in mod.REGISTERED["adv_estimator"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_verl
def test_full_verl_run_on_tiny_thinker(tmp_path):
    """verl's PPO trainer, 2 steps on the tiny thinker (benchmarks/device/verl_ppo_tiny.sh:
    its rollout is a vLLM server, so it needs a GPU and verl[vllm])."""
    r = omni_recipe(
        tmp_path,
        model={"path": str(tmp_path / "thinker"), "tiny": "qwen3_omni_thinker"},
        data={"prompts_per_step": 2},
        algorithm={"num_minibatches": 1},
        rollout={"n": 2, "max_new_tokens": 4},
        trainer={
            "steps": 2,
            "gpus_per_node": 1,
            "verl": {"actor_rollout_ref.rollout.gpu_memory_utilization": 0.3},
        },
    )
    vb.run_verl(r, tmp_path / "run")
    assert (tmp_path / "run" / "verl_config.json").is_file()
