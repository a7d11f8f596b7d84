"""`algorithm.reuse_rollout_forward`: the update back-propagates through the rollout's own
forwards of the trained SDE steps instead of replaying them.

The gradients are read off one plain SGD step with learning rate 1 (``p <- p - grad``, no
clipping) on the tiny SD3's LoRA, from one rollout: through the rollout's graph, and by the
replay of the same trajectories (their log-probs detached), which is what the update runs
without the key.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from omni_train_testutils import local_loop

from omni_train.algorithms import algorithm
from omni_train.recipe import RecipeError, recipe_from_dict
from omni_train.updates import (
    UpdateContext,
    UpdateSettings,
    make_update_plans,
    run_update,
    update_plans,
)


@pytest.mark.parametrize(
    "name, lora, sde_kind",
    [
        ("flow_grpo", True, "sde"),
        ("flow_grpo", False, "sde"),  # full fine-tuning: every transformer weight
        ("mix_grpo", True, "sde"),
        ("dance_grpo", True, "dance"),
    ],
    ids=["flow_grpo", "flow_grpo-full", "mix_grpo", "dance_grpo"],
)
def test_backward_through_the_rollout_equals_the_replay(
    train_dict, tmp_path: Path, name, lora, sde_kind
):
    d = train_dict(
        algorithm={"name": name, "reuse_rollout_forward": True, "clip_range": 0.2},
        lora={"enabled": lora},
        trainer={"sample_every": 0},
    )
    # flow_grpo: windows of 3 of 5 steps at per-sample starts (the rollout's forwards run
    # with autograd for the rows inside their window only); mix_grpo: one shared window
    d["rollout"].update(
        {"num_steps": 5, "sde_window_size": 3, "sde_window_range": [0, 4], "sde_kind": sde_kind}
    )
    recipe = recipe_from_dict(d)
    loop = local_loop(recipe, tmp_path / "run")
    adapter, params = loop.learner.adapter, loop.learner.params_named
    engine = loop.ports.rollout
    assert engine.grad_denoiser is adapter  # autograd on the learner's own, unmerged weights
    assert (engine.denoiser is not adapter) == lora  # the rest on the merged copy (LoRA)
    reqs = loop.requests_for(0)
    trajs = loop.ports.rollout.generate_many(reqs, differentiable=True)
    plain = loop.ports.rollout.generate_many(reqs)
    for a, b in zip(plain, trajs):
        torch.testing.assert_close(b.latents, a.latents, rtol=0, atol=1e-6)
        torch.testing.assert_close(b.log_probs.detach(), a.log_probs, rtol=0, atol=1e-5)
    rewards, _, _ = loop.score(trajs, 0)
    batch, _ = loop.update_batch(trajs, rewards, 0)
    n, steps = batch.log_probs.shape
    assert batch.log_probs.requires_grad and (n, steps) == (8, 3)
    if name != "mix_grpo":
        assert len({t.window for t in trajs}) > 1

    start = {k: v.detach().clone() for k, v in params.items()}
    # policy/kl_to_ref's two no-grad passes after the update left out: they are forwards
    settings = dataclasses.replace(
        UpdateSettings.from_recipe(recipe), grad_clip=1e9, measure_kl_ref=False
    )
    rows_seen: list[int] = []
    hook = adapter.model.register_forward_pre_hook(
        lambda _m, args, kwargs: rows_seen.append(int(kwargs["hidden_states"].shape[0])),
        with_kwargs=True,
    )

    def gradients(batch, plan) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        # the rollout's graph holds the weights it ran on: they are `start` until its update
        if not batch.log_probs.requires_grad:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(start[k])
        sgd = torch.optim.SGD(list(params.values()), lr=1.0)
        ctx = UpdateContext(adapter, sgd, list(params.values()), algorithm(name), settings)
        rows_seen.clear()
        metrics = run_update(ctx, batch, plan)
        return {k: start[k] - p.detach() for k, p in params.items()}, metrics

    (split,) = make_update_plans(n, num_minibatches=2, epochs=1, seed=0, step=0, items=steps)
    sgd = torch.optim.SGD(list(params.values()), lr=1.0)
    ctx = UpdateContext(adapter, sgd, list(params.values()), algorithm(name), settings)
    with pytest.raises(ValueError, match=r"reuse_rollout_forward.*2 steps"):
        run_update(ctx, batch, split)  # refused before any backward: the graph stays whole
    (plan,) = update_plans(recipe, batch, 0, world_size=1)
    assert len(plan.steps) == 1 and len(plan.steps[0].chunks) == 1 and plan.steps[0].pack == 3
    through_rollout, metrics = gradients(batch, plan)
    assert rows_seen == []  # the update ran no forward of its own
    assert metrics["rollout/logprob_diff_max"] == 0.0
    replay = dataclasses.replace(batch, log_probs=batch.log_probs.detach())
    (plan,) = make_update_plans(n, num_minibatches=1, epochs=1, seed=0, step=0, items=steps)
    replayed, replay_metrics = gradients(replay, plan)
    hook.remove()
    loop.ports.close()
    assert len(rows_seen) == steps  # the replay: one forward per window step
    assert replay_metrics["rollout/logprob_diff_max"] < 1e-4  # unmerged rollout = learner
    biggest = max(g.abs().max().item() for g in replayed.values())
    assert biggest > 1e-6  # the step trains something
    for k, g in replayed.items():  # to 1e-5, and to 1e-5 of the largest gradient entry
        # (or to what `start - p` can read: two float32 roundings of the weight itself, which
        # in full fine-tuning is larger than the gradient)
        readable = 2 * torch.finfo(torch.float32).eps * start[k].abs().max().item()
        tol = max(1e-5 * min(1.0, biggest), readable)
        assert (through_rollout[k] - g).abs().max().item() <= tol, k
    assert metrics["loss"] == pytest.approx(replay_metrics["loss"], abs=1e-6)


def test_a_run_trains_through_its_rollout(train_dict, tmp_path: Path):
    from omni_train.train import train

    d = train_dict(
        algorithm={"name": "flow_grpo", "reuse_rollout_forward": True},
        trainer={"steps": 2, "sample_every": 1, "val_every": 2},
    )
    recipe = recipe_from_dict(d)
    rows = train(recipe)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_max"] == 0.0 and r["actor/grad_norm"] > 0
        assert r["rollout/graph_kept"] == 1.0
    assert "val/reward_mean" in rows[-1]
    out = recipe.output_dir()
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(x.get("step") == 2 for x in logged)
    assert (out / "samples" / "step_0002.png").is_file()


@pytest.mark.parametrize(
    "change, words",
    [
        ({"algorithm": {"name": "flow_dppo"}}, "flow_dppo does not train"),
        ({"algorithm": {"name": "diffusion_nft"}}, "diffusion_nft does not train"),
        ({"algorithm": {"num_minibatches": 2}}, "num_minibatches 1"),
        ({"algorithm": {"epochs": 2}}, "epochs 1"),
        ({"algorithm": {"kl_beta": 0.01}}, "kl_beta"),
        ({"algorithm": {"rollout_correction": "bypass"}}, "rollout_correction"),
        ({"algorithm": {"rows_per_forward": "auto"}}, "rows_per_forward"),
        ({"trainer": {"mode": "async"}}, "trainer.mode sync"),
        ({"trainer": {"backend": "ray"}}, "trainer.backend local"),
        ({"rollout": {"backend": "http", "url": "http://127.0.0.1:1"}}, "rollout.backend"),
    ],
)
def test_the_schema_refuses_what_it_cannot_reuse(train_dict, change, words):
    d = train_dict(algorithm={"reuse_rollout_forward": True})
    for section, values in change.items():
        d[section].update(values)
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(d)
    msg = str(err.value)
    assert "algorithm.reuse_rollout_forward" in msg and words in msg, msg


def test_the_rollouts_graph_is_checked_against_the_free_memory(
    train_dict, tmp_path: Path, monkeypatch
):
    """The activations the rollout keeps until the update (samples x trained steps) are
    estimated at its first forward with autograd and refused, naming the key, when they
    exceed the budget; the estimate is of the order of what autograd saves."""
    from omni_train.errors import TrainError
    from omni_train.train import train
    from omni_train.updates import reuse_memory

    d = train_dict(
        algorithm={"name": "flow_grpo", "reuse_rollout_forward": True},
        trainer={"steps": 2, "sample_every": 0},
    )
    d["rollout"].update({"num_steps": 5, "sde_window_size": 3, "sde_window_range": [0, 4]})
    recipe = recipe_from_dict(d)
    loop = local_loop(recipe, tmp_path / "run")
    check = loop.learner.reuse_memory
    assert check is not None and check.needed_bytes is None
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and not isinstance(t, torch.nn.Parameter):
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trajs = loop.ports.rollout.generate_many(loop.requests_for(0), differentiable=True)
    assert trajs[0].log_probs.requires_grad
    assert check.needed_bytes is not None  # checked at the first forward with autograd
    # (the tiny SD3: 4.78 MiB estimated, 4.94 MiB saved)
    assert sum(saved) / 2 < check.needed_bytes < 2 * sum(saved)
    loop.ports.close()

    needed = check.needed_bytes
    monkeypatch.setattr(reuse_memory, "free_memory_bytes", lambda _device: needed)  # budget: half
    with pytest.raises(TrainError, match=r"reuse_rollout_forward: the rollout would keep the "
                       r"activations of 8 samples x 3 trained steps"):  # fmt: skip
        train(
            recipe_from_dict({**d, "trainer": {**d["trainer"], "output_dir": str(tmp_path / "b")}})
        )
    log = tmp_path / "b" / "metrics.jsonl"  # stopped in the first rollout: no step trained
    assert not log.exists() or all(
        json.loads(x).get("step", 0) == 0 for x in log.read_text().splitlines()
    )
    assert not (tmp_path / "b" / "checkpoint").exists()
    monkeypatch.setattr(reuse_memory, "free_memory_bytes", lambda _device: 2.5 * needed)
    rows = train(
        recipe_from_dict({**d, "trainer": {**d["trainer"], "output_dir": str(tmp_path / "c")}})
    )
    assert [r["step"] for r in rows] == [1, 2]


def test_auto_reuses_what_true_admits_and_replays_the_rest(train_dict):
    """`auto` (the default) is `true` on a recipe that `true` admits and `false` on one it
    refuses, where it refuses nothing."""
    assert recipe_from_dict(train_dict()).algorithm.reuse_rollout_forward == "auto"
    assert recipe_from_dict(train_dict(algorithm={"name": "flow_grpo"})).reuses_rollout_forward()
    for change in (
        {"name": "flow_dppo"},
        {"name": "diffusion_nft"},
        {"name": "flow_grpo", "num_minibatches": 2},
        {"name": "flow_grpo", "kl_beta": 0.01},
        {"name": "flow_grpo", "reuse_rollout_forward": False},
    ):
        assert not recipe_from_dict(train_dict(algorithm=change)).reuses_rollout_forward()
    d = train_dict(algorithm={"name": "flow_grpo"}, trainer={"mode": "async"})
    assert not recipe_from_dict(d).reuses_rollout_forward()


def test_auto_falls_back_to_the_replay_when_the_graph_does_not_fit(
    train_dict, tmp_path: Path, monkeypatch, capsys
):
    """With `auto`, a batch whose graph would exceed the budget rolls out again without it
    and the run replays from then on: the same run, bit for bit, as `false`."""
    from omni_train.train import train
    from omni_train.updates import reuse_memory

    monkeypatch.setattr(reuse_memory, "free_memory_bytes", lambda _device: 1.0)

    def run(choice, name: str) -> list[dict]:
        d = train_dict(
            algorithm={"name": "flow_grpo", "reuse_rollout_forward": choice},
            trainer={"steps": 2, "sample_every": 0, "output_dir": str(tmp_path / name)},
        )
        return train(recipe_from_dict(d))

    auto = run("auto", "auto")
    said = capsys.readouterr()
    assert "auto: the update replays the trained steps from now on" in said.out + said.err
    replay = run(False, "replay")
    assert [r["step"] for r in auto] == [1, 2]
    for a, b in zip(auto, replay):
        assert a["actor/grad_norm"] == b["actor/grad_norm"] and a["loss"] == b["loss"]
        assert a["rollout/graph_kept"] == 0.0 and "rollout/graph_kept" not in b
    lora = "checkpoint/step_0002/lora/adapter_model.safetensors"
    assert (tmp_path / "auto" / lora).read_bytes() == (tmp_path / "replay" / lora).read_bytes()
