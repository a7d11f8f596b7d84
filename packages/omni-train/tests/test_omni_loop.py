"""The omni (autoregressive) loop: GSPO/GRPO on the tiny Qwen3-Omni thinker."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from omni_train_testutils import without_timings

from omni_train import resume, train
from omni_train.backends import make_ports
from omni_train.errors import TrainError
from omni_train.logger import read_metrics
from omni_train.loops import OmniLoop
from omni_train.recipe import RecipeError, recipe_from_dict


def _omni_dict(tmp_path: Path, model: Path, **sections) -> dict:
    d = {
        "experiment": "omni-test",
        "model": {"path": str(model), "tiny": "qwen3_omni_thinker"},
        "lora": {"rank": 4, "alpha": 8},
        "data": {
            "task": "shapes",
            "task_options": {"image_size": 32},
            "task_size": 16,
            "val_size": 4,
            "prompts_per_step": 2,
        },
        "rollout": {"n": 4, "max_new_tokens": 3, "temperature": 1.0, "max_num_seqs": 8},
        "reward": {"name": "choice", "options": {"letters": "ABCD"}, "extract": "first_letter"},
        "algorithm": {"name": "gspo"},
        "optimizer": {"lr": 1e-2},
        "trainer": {
            "steps": 2,
            "output_dir": str(tmp_path / "run"),
            "progress": False,
            "val_every": 2,
            "sample_every": 1,
        },
    }
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return d


def test_two_gspo_steps_write_metrics_and_replay_matches(tiny_thinker, tmp_path: Path) -> None:
    recipe = recipe_from_dict(
        _omni_dict(tmp_path, tiny_thinker, trainer={"report_to": ["tensorboard"]})
    )
    assert recipe.is_omni()
    loop = OmniLoop(recipe, make_ports(recipe))
    params = loop.learner.params_named
    before = {k: v.detach().clone() for k, v in params.items()}
    rows = loop.train()
    assert [r["step"] for r in rows] == [1, 2]
    on_disk = read_metrics(Path(recipe.trainer.output_dir) / "metrics.jsonl")
    assert on_disk[0]["step"] == 0 and "val/reward_mean" in on_disk[0]  # the baseline
    on_disk = on_disk[1:]
    assert without_timings(on_disk) == without_timings(rows)
    for key in ("reward/mean", "loss", "actor/grad_norm", "rollout/logprob_abs_diff_max"):
        assert key in on_disk[0], key
    # minibatch 0 replays the responses on the rollout weights: the log-probs agree
    assert on_disk[0]["rollout/logprob_abs_diff_max"] < 1e-4
    assert "val/reward_mean" in on_disk[1]
    changed = [k for k, v in params.items() if not torch.equal(v, before[k])]
    assert changed, "the update changed no LoRA parameter"
    run = Path(recipe.trainer.output_dir)
    assert (run / "reward_curve.png").is_file()
    assert (run / "checkpoint" / "step_0002" / "state.json").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert "reward/mean" in events.Tags()["scalars"]
    assert [e.step for e in events.Images("samples")] == [1, 2]  # sample_every: 1


def test_omni_resume_equals_uninterrupted(tiny_thinker, tmp_path: Path, monkeypatch) -> None:
    common = {"steps": 3, "save_every": 1, "val_every": 0, "sample_every": 0}
    full = train(
        recipe_from_dict(
            _omni_dict(
                tmp_path, tiny_thinker, trainer={**common, "output_dir": str(tmp_path / "a")}
            )
        )
    )
    run = tmp_path / "killed"
    recipe = recipe_from_dict(
        _omni_dict(tmp_path, tiny_thinker, trainer={**common, "output_dir": str(run)})
    )
    orig = OmniLoop.train_step

    def dying(self, step):
        row = orig(self, step)
        if step == 1:
            raise KeyboardInterrupt
        return row

    monkeypatch.setattr(OmniLoop, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        train(recipe)
    monkeypatch.setattr(OmniLoop, "train_step", orig)
    resume(run)
    resumed = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert without_timings(resumed) == without_timings(full)


def test_constrained_decoding_rollout_matches_replay(tiny_thinker, tmp_path: Path) -> None:
    """`rollout.allowed_tokens`: rollout and validation emit only the allowed letters, and the
    replay of the masked distribution reproduces the rollout log-probs (< 1e-4)."""
    d = _omni_dict(tmp_path, tiny_thinker, rollout={"allowed_tokens": ["A", "B", "C", "D"]})
    recipe = recipe_from_dict(d)
    ports = make_ports(recipe)
    loop = OmniLoop(recipe, ports)
    rows = loop.train()
    for row in rows:
        assert row["rollout/logprob_abs_diff_max"] < 1e-4, row["rollout/logprob_abs_diff_max"]
    sampler, adapter = ports.rollout, ports.learner.adapter
    items = loop.val_items
    greedy = sampler.generate(items, list(range(len(items))), temperature=0.0, top_p=1.0)
    assert all(set(text) <= set("ABCD") for text in greedy["texts"])
    items = loop.data.prompts_for_step(5)
    out = sampler.generate(items, list(range(len(items))), temperature=1.0, top_p=1.0)
    assert all(set(text) <= set("ABCD") for text in out["texts"])
    allowed = sampler.allowed_tokens or []
    assert set(out["tokens"][out["mask"]].tolist()) <= set(allowed)
    # without the mask in the replay the log-probs differ: the mask is what is trained
    t = max(int(out["mask"].sum(-1).max()), 1)
    images = [it.image for it in items if it.image is not None]
    rb = {
        **adapter.build_batch([it.content() for it in items], images=images or None),
        "responses": out["tokens"][:, :t],
        "response_mask": out["mask"][:, :t],
        "temperature": out["temperature"],
    }
    mask = out["mask"][:, :t]
    with torch.no_grad():
        free = adapter.token_log_probs(rb)
        masked = adapter.token_log_probs({**rb, "allowed_tokens": allowed})
    assert (masked - out["log_probs"][:, :t])[mask].abs().max() < 1e-4
    assert (masked - free)[mask].min() > 1e-3


def test_allowed_tokens_error_names_the_field(tiny_thinker, tmp_path: Path) -> None:
    d = _omni_dict(tmp_path, tiny_thinker, rollout={"allowed_tokens": ["A", ""]})
    with pytest.raises(RecipeError, match=r"rollout\.allowed_tokens: '' "):
        make_ports(recipe_from_dict(d))
    d = _omni_dict(tmp_path, tiny_thinker, rollout={"allowed_tokens": ["<|image_pad|>"]})
    with pytest.raises(RecipeError, match=r"rollout\.allowed_tokens: .*cannot emit"):
        make_ports(recipe_from_dict(d))


def test_omni_errors_name_the_field(tiny_thinker, tmp_path: Path) -> None:
    d = _omni_dict(tmp_path, tiny_thinker)
    d["data"]["val_prompts"] = ["what colour?"]  # no reference answers to validate against
    with pytest.raises(RecipeError, match=r"data\.val_prompts: the omni path"):
        recipe_from_dict(d)
    d = _omni_dict(tmp_path, tiny_thinker)
    d["data"] = {"prompts": ["no answers here"], "prompts_per_step": 1}
    with pytest.raises((RecipeError, TrainError), match="data"):
        train(recipe_from_dict(d))
    d = _omni_dict(tmp_path, tiny_thinker, algorithm={"name": "flow_grpo"})
    with pytest.raises((RecipeError, TrainError, ValueError), match=r"algorithm\.name"):
        train(recipe_from_dict(d))


@pytest.mark.parametrize("variant", ["grpo", "ema", "full"])
def test_omni_variants_train_end_to_end(tiny_thinker, tmp_path: Path, variant) -> None:
    """GRPO, an EMA of the LoRA (validation samples the EMA), and full fine-tuning of a few
    weights without LoRA, each through the whole omni loop with validation: the replay agrees
    with the rollout and the update moves what it trains, and nothing else."""
    over = {
        "grpo": {"algorithm": {"name": "grpo"}},
        "ema": {"optimizer": {"lr": 1e-2, "ema_decay": 0.5}},
        "full": {"lora": {"enabled": False, "full_regex": r".*layers\.1\.self_attn\.q_proj\..*"}},
    }[variant]
    recipe = recipe_from_dict(_omni_dict(tmp_path, tiny_thinker, **over))
    loop = OmniLoop(recipe, make_ports(recipe))
    params = loop.learner.params_named
    before = {k: v.detach().clone() for k, v in params.items()}
    sampled_with = []  # the adapter the rollout samples with, per call
    generate = loop.ports.rollout.generate

    def recorded(*args, **kwargs):
        sampled_with.append(loop.learner.adapter.active_adapter())
        return generate(*args, **kwargs)

    loop.ports.rollout.generate = recorded
    rows = loop.train()
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["rollout/logprob_abs_diff_max"] < 1e-4
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert "val/reward_mean" in rows[1]
    if variant == "ema":  # validation (baseline, after step 2) on the EMA, training on the policy
        assert sampled_with == ["ema", "default", "default", "ema"], sampled_with
    assert [k for k, v in params.items() if not torch.equal(v, before[k])]
    if variant == "full":
        assert params and all("layers.1.self_attn.q_proj." in k for k in params), list(params)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_omni_on_ray_trains_as_on_the_local_backend(ray_session, tiny_thinker, tmp_path) -> None:
    """The omni loop on trainer.backend ray (the thinker's rollout worker pool with constrained
    decoding, an FSDP learner, validation through the pool, a checkpoint) gives the local
    backend's metrics, step for step."""
    common = {"val_every": 2, "save_every": 2, "threads": 1}
    allowed = {"allowed_tokens": ["A", "B", "C", "D"]}
    runs = {}
    for backend in ("local", "ray"):
        trainer = {**common, "backend": backend, "output_dir": str(tmp_path / backend)}
        if backend == "ray":
            trainer["num_workers"] = 1
        d = _omni_dict(tmp_path, tiny_thinker, rollout=allowed, trainer=trainer)
        runs[backend] = train(recipe_from_dict(d))
        assert (tmp_path / backend / "checkpoint" / "step_0002" / "state.json").is_file()
    keys = ("loss", "reward/mean", "rollout/logprob_abs_diff_max", "actor/ppo_kl")
    for a, b in zip(runs["local"], runs["ray"], strict=True):
        for k in keys:
            assert b[k] == pytest.approx(a[k], abs=1e-6), (k, a[k], b[k])
    assert runs["ray"][1]["val/reward_mean"] == runs["local"][1]["val/reward_mean"]


@pytest.mark.parametrize(
    ("name", "algorithm", "clips"),
    [
        ("gspo", {}, (3e-4, 4e-4)),  # the loss's own defaults
        ("grpo", {}, (0.2, 0.2)),
        ("gspo", {"clip_range": 0.1}, (0.1, 0.1)),  # algorithm.clip_range: both sides
        ("grpo", {"clip_range": 0.1, "options": {"clip_high": 0.3}}, (0.1, 0.3)),
    ],
)
def test_the_token_loss_clips_by_the_recipe_on_the_local_backend_as_on_verl(
    tiny_thinker, tmp_path: Path, monkeypatch, name, algorithm, clips
) -> None:
    """The clip the local update hands the token loss is the one `build_verl_config` hands
    verl's actor for the same recipe (`algorithm.clip_range` was once ignored here and
    mapped there)."""
    from omni_algos import losses
    from omni_train.backends.verl_backend import build_verl_config

    seen: list[tuple[float, float]] = []
    loss_fn = losses.LOSSES[name]

    @functools.wraps(loss_fn)  # its signature: the update reads the loss's defaults from it
    def recorded(*args, **kwargs):
        seen.append((kwargs["clip_low"], kwargs["clip_high"]))
        return loss_fn(*args, **kwargs)

    monkeypatch.setitem(losses.LOSSES, name, recorded)
    d = _omni_dict(tmp_path, tiny_thinker, algorithm={"name": name, **algorithm})
    d["trainer"].update(steps=1, val_every=0, sample_every=0)
    train(recipe_from_dict(d))
    assert seen and set(seen) == {clips}, seen
    d["trainer"] = {**d["trainer"], "backend": "verl", "gpus_per_node": 1}
    d["algorithm"]["rows_per_forward"] = None
    actor = build_verl_config(recipe_from_dict(d))["actor_rollout_ref"]["actor"]
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == clips
