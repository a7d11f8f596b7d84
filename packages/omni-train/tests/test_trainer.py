from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omni_train_testutils import local_loop, rollout_and_score, without_timings

from omni_adapters import weights_checksum
from omni_train import resume, train
from omni_train.errors import NonFiniteError, TrainError
from omni_train.logger import read_metrics
from omni_train.loops import DiffusionLoop
from omni_train.recipe import RecipeError, recipe_from_dict

REQUIRED = [
    "step",
    "reward/mean",
    "reward/std",
    "loss",
    "actor/ratio_mean",
    "actor/clipfrac",
    "actor/approx_kl",
    "actor/grad_norm",
    "timing/rollout_s",
    "timing/reward_s",
    "timing/update_s",
    "perf/images_per_s",
]


def test_two_steps_write_everything(train_dict, tmp_path: Path) -> None:
    recipe = recipe_from_dict(train_dict(trainer={"val_every": 2}))
    rows = train(recipe)
    run = Path(recipe.trainer.output_dir)
    assert len(rows) == 2
    everything = read_metrics(run / "metrics.jsonl")
    # step 0 is the validation baseline (before any update); steps 1, 2 are the training steps
    assert [r["step"] for r in everything] == [0, 1, 2]
    assert set(everything[0]) == {"step", "val/reward_mean", "val/reward_std"}
    on_disk = everything[1:]
    for key in REQUIRED:
        assert key in on_disk[0], key
    assert on_disk[0]["rollout/rows"] == 8
    assert on_disk[1]["rollout/version"] == 1  # step 2 rolled out on the weights after step 1
    assert on_disk[1]["weights/version"] == 2
    # minibatch 0 replays on the rollout weights: the recomputed log-probs agree
    assert on_disk[0]["rollout/logprob_diff_max"] < 1e-4
    assert on_disk[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert "val/reward_mean" in on_disk[1]
    assert 0 <= on_disk[0]["reward/frac_zero_std"] <= 1 and on_disk[0]["samples/diversity"] > 0
    assert on_disk[0]["optim/lr"] == recipe.optimizer.lr
    assert "policy/kl_to_ref" in on_disk[0]  # where the policy stands against the base model
    assert (run / "samples" / "step_0001.png").is_file()
    assert (run / "samples" / "val_step_0000.png").is_file()
    assert (run / "samples" / "val_step_0002.png").is_file()
    assert (run / "reward_curve.png").is_file()
    ck = run / "checkpoint" / "step_0002"
    for f in (
        "trainable.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "rng.safetensors",
        "state.json",
        "lora/adapter_model.safetensors",
        "lora/adapter_config.json",
        "lora/pytorch_lora_weights.safetensors",
    ):
        assert (ck / f).is_file(), f
    assert json.loads((ck / "state.json").read_text())["version"] == 2
    assert (run / "recipe.yaml").is_file()


def test_weights_change_and_reach_engine(train_dict, tmp_path: Path) -> None:
    recipe = recipe_from_dict(train_dict(trainer={"steps": 1, "sample_every": 0}))
    loop = local_loop(recipe, tmp_path / "run")
    params = loop.learner.params_named
    before = {k: v.detach().clone() for k, v in params.items()}
    loop.train()
    changed = [k for k, v in params.items() if not torch.equal(v, before[k])]
    assert changed, "the update changed no LoRA parameter"
    assert loop.ports.rollout.version == 1
    # the engine samples a merged copy of the policy, synced to the learner's LoRA tensors
    rollout = loop.ports.rollout.denoiser
    assert rollout.is_merged and not loop.learner.adapter.is_merged
    assert weights_checksum(rollout.export_rollout_weights()) == weights_checksum(
        loop.learner.rollout_weights()
    )
    loop.ports.close()


def test_same_seed_same_metrics_other_seed_differs(train_dict, tmp_path: Path) -> None:
    a = train(recipe_from_dict(train_dict(trainer={"output_dir": str(tmp_path / "a")})))
    b = train(recipe_from_dict(train_dict(trainer={"output_dir": str(tmp_path / "b")})))
    c = train(recipe_from_dict(train_dict(trainer={"output_dir": str(tmp_path / "c"), "seed": 5})))
    assert without_timings(a) == without_timings(b)
    assert without_timings(a) != without_timings(c)


@pytest.mark.parametrize(
    "alg",
    [
        {"num_minibatches": 2, "clip_range": 0.2},
        # the update back-propagates through the rollout: resumed, it repeats too
        {"reuse_rollout_forward": True, "clip_range": 0.2},
    ],
    ids=["two-minibatches", "reuse-rollout-forward"],
)
def test_resume_equals_uninterrupted(train_dict, tmp_path: Path, monkeypatch, alg) -> None:
    common = {"steps": 4, "save_every": 2, "sample_every": 0}
    full = train(
        recipe_from_dict(
            train_dict(trainer={**common, "output_dir": str(tmp_path / "full")}, algorithm=alg)
        )
    )

    run = tmp_path / "killed"
    recipe = recipe_from_dict(train_dict(trainer={**common, "output_dir": str(run)}, algorithm=alg))
    orig = DiffusionLoop.train_step

    def dying(self, step, rollout):
        row = orig(self, step, rollout)
        if step == 2:  # step 2 is logged, but the last checkpoint is after step 1
            raise KeyboardInterrupt
        return row

    monkeypatch.setattr(DiffusionLoop, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        train(recipe)
    monkeypatch.setattr(DiffusionLoop, "train_step", orig)
    assert len(read_metrics(run / "metrics.jsonl")) == 3
    resume(run)
    resumed = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert without_timings(resumed) == without_timings(full)


def test_missing_model_path_is_clear(train_dict, tmp_path: Path) -> None:
    d = train_dict()
    d["model"] = {"path": str(tmp_path / "nowhere")}
    with pytest.raises(TrainError, match=r"model.path: .*nowhere does not exist.*model.tiny"):
        train(recipe_from_dict(d))


def _tiny_recipe(path: Path, seed: int = 0) -> Any:
    """Just the `model` section `ensure_model` reads."""
    from types import SimpleNamespace

    return SimpleNamespace(model=SimpleNamespace(path=str(path), tiny="sd3", tiny_seed=seed))


def test_tiny_build_race_keeps_the_other_runs_model(tmp_path: Path, monkeypatch) -> None:
    """Two runs building the same tiny model at once: the loser keeps the winner's folder."""
    from omni_adapters import tiny
    from omni_train.models import ensure_model

    target = tmp_path / "models" / "sd3"

    def build_while_another_finishes(family: str, path: Path, seed: int = 0) -> Path:
        Path(path).mkdir(parents=True)
        (Path(path) / "config.json").write_text('{"ours": true}')
        target.mkdir(parents=True)  # the other run renamed its build into place first
        (target / "config.json").write_text('{"theirs": true}')
        return Path(path)

    monkeypatch.setattr(tiny, "build", build_while_another_finishes)
    assert ensure_model(_tiny_recipe(target)) == target
    assert json.loads((target / "config.json").read_text()) == {"theirs": True}
    assert [p.name for p in target.parent.iterdir()] == ["sd3"]  # no leftover build folder


def test_stale_tiny_model_is_rebuilt(tmp_path: Path, monkeypatch) -> None:
    """A cached tiny model whose stamp names another seed or builder revision is rebuilt; a
    current one, or a folder without a stamp, is used as is."""
    from omni_adapters import tiny
    from omni_train.models import ensure_model

    built: list[int] = []

    def fake_build(family: str, path: Path, seed: int = 0) -> Path:
        Path(path).mkdir(parents=True)
        (Path(path) / "config.json").write_text(json.dumps({"seed": seed}))
        (Path(path) / tiny.STAMP_FILE).write_text(json.dumps(tiny.build_stamp(family, seed)))
        built.append(seed)
        return Path(path)

    monkeypatch.setattr(tiny, "build", fake_build)
    target = tmp_path / "models" / "sd3"

    ensure_model(_tiny_recipe(target, 0))
    ensure_model(_tiny_recipe(target, 0))  # current: kept
    assert built == [0]
    ensure_model(_tiny_recipe(target, 3))  # another seed: rebuilt
    assert built == [0, 3] and json.loads((target / "config.json").read_text()) == {"seed": 3}
    stamp = json.loads((target / tiny.STAMP_FILE).read_text())
    (target / tiny.STAMP_FILE).write_text(json.dumps({**stamp, "revision": 0}))
    ensure_model(_tiny_recipe(target, 3))  # an older builder revision: rebuilt
    assert built == [0, 3, 3]
    (target / tiny.STAMP_FILE).unlink()
    ensure_model(_tiny_recipe(target, 5))  # no stamp: not known to be a tiny build, used as is
    assert built == [0, 3, 3]
    assert sorted(p.name for p in target.parent.iterdir()) == ["sd3"]


def test_unknown_reward_and_missing_extra(train_dict, monkeypatch) -> None:
    import omni_rewards

    with pytest.raises(TrainError, match=re.escape("reward.name: unknown reward 'nope'")):
        train(recipe_from_dict(train_dict(reward={"name": "nope"})))
    bad_option = train_dict(reward={"name": "brightness", "options": {"foo": 1}})
    with pytest.raises(TrainError, match=re.escape("reward.options: reward 'brightness' has no")):
        train(recipe_from_dict(bad_option))

    def needs_extra(**options):
        raise omni_rewards.MissingDependencyError(
            "reward 'fancy' needs the python package 'fancylib', which is not installed: "
            "pip install 'omni-rewards[fancy]'"
        )

    monkeypatch.setitem(omni_rewards.REWARDS, "fancy", needs_extra)
    with pytest.raises(TrainError, match=r"pip install 'omni-rewards\[fancy\]'"):
        train(recipe_from_dict(train_dict(reward={"name": "fancy"})))


def test_nan_reward_stops_with_step_and_samples(train_dict, tmp_path: Path, monkeypatch) -> None:
    import omni_rewards

    class Flaky(omni_rewards.Reward):
        name = "flaky"
        calls = 0

        def score_batch(self, inp):
            Flaky.calls += 1
            s = np.full(inp.batch_size, 0.5, dtype=np.float32)
            if Flaky.calls == 2:
                s[3] = np.nan
            return omni_rewards.RewardOutput(s)

    monkeypatch.setitem(omni_rewards.REWARDS, "flaky", Flaky)
    recipe = recipe_from_dict(train_dict(reward={"name": "flaky"}, trainer={"steps": 3}))
    with pytest.raises(NonFiniteError, match="step 2: non-finite reward") as exc:
        train(recipe)
    out = Path(recipe.trainer.output_dir) / "nonfinite" / "step_0002"
    assert str(out) in str(exc.value)
    data = json.loads((out / "samples.json").read_text())
    assert len(data["samples"]) == 8 and (out / "samples.png").is_file()
    assert len(read_metrics(Path(recipe.trainer.output_dir) / "metrics.jsonl")) == 1


def test_tensorboard_scalars(train_dict) -> None:
    recipe = recipe_from_dict(train_dict(trainer={"steps": 1, "report_to": ["tensorboard"]}))
    try:
        import tensorboard  # noqa: F401
    except ImportError:  # the extra is not installed: a clear error, not a stack trace
        with pytest.raises(TrainError, match=r"pip install 'omni-train\[tensorboard\]'"):
            train(recipe)
        return
    train(recipe)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(Path(recipe.trainer.output_dir) / "tensorboard"))
    ev.Reload()
    assert "reward/mean" in ev.Tags()["scalars"]
    assert "samples" in ev.Tags()["images"]


def test_wandb_offline_logs_and_resume_continues_the_run(train_dict, monkeypatch) -> None:
    wandb = pytest.importorskip("wandb")  # the workspace installs it; a bare install may not
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = recipe_from_dict(
        train_dict(trainer={"steps": 2, "report_to": ["wandb"], "save_every": 1})
    )
    train(recipe)
    run = Path(recipe.trainer.output_dir)
    run_id = (run / "wandb_id.txt").read_text().strip()
    (offline,) = (run / "wandb").glob(f"offline-run-*-{run_id}")
    assert list(offline.glob(f"run-{run_id}.wandb")), "no wandb event file"
    resume(run, ["trainer.steps=3"])  # the resumed run logs into the same wandb run id
    assert (run / "wandb_id.txt").read_text().strip() == run_id
    assert wandb.run is None  # the logger finished its run


def _one_update(recipe, run_dir: Path, tamper=None):
    """Roll out, score and update step 0; returns (metrics, trainable weights after)."""
    loop = local_loop(recipe, run_dir)
    trajs, rewards = rollout_and_score(loop)
    if tamper is not None:
        tamper(trajs)
    batch, _ = loop.update_batch(trajs, rewards, 0)
    correction = recipe.algorithm.rollout_correction
    metrics = loop.learner.update(batch, 0, None if correction == "off" else correction)
    weights = {k: v.detach().clone() for k, v in loop.learner.params_named.items()}
    loop.ports.close()
    return metrics, weights


def test_micro_batches_and_packing_give_the_same_step(train_dict, tmp_path: Path) -> None:
    """A minibatch of 8 rows in one forward per window step, in micro-batches of 3 (3 + 3 + 2
    rows, one window step each), and in micro-batches of 4 that pack both window steps into
    one forward: the same optimizer step."""
    weights, losses = [], []
    for rows in (8, 3, 4):
        d = train_dict(algorithm={"rows_per_forward": rows}, trainer={"sample_every": 0})
        if rows == 8:
            d["rollout"]["max_num_seqs"] = 8
        m, w = _one_update(recipe_from_dict(d), tmp_path / f"rows{rows}")
        losses.append(m["loss"])
        weights.append(w)
    moved = False
    for other, loss in zip(weights[1:], losses[1:]):
        assert loss == pytest.approx(losses[0], abs=1e-6)
        for k in weights[0]:
            torch.testing.assert_close(other[k], weights[0][k], atol=2e-6, rtol=0)
            moved |= bool((weights[0][k] != 0).any())
    assert moved


def test_rollout_correction_weights_and_rejects(train_dict, tmp_path: Path) -> None:
    """On matching log-probs the correction is a no-op; rows whose rollout log-prob is off by
    +2 (IS ratio e^-2, outside [0.5, 2]) are rejected."""
    rows = {}

    def mismatch(trajs) -> None:  # a mismatched rollout engine on half the rows
        for tr in trajs[:4]:
            tr.log_probs = tr.log_probs + 2.0

    for mode in ("off", "decoupled", "bypass"):
        d = train_dict(algorithm={"rollout_correction": mode}, trainer={"sample_every": 0})
        tamper = mismatch if mode == "bypass" else None
        rows[mode], _ = _one_update(recipe_from_dict(d), tmp_path / mode, tamper)
    assert rows["decoupled"]["loss"] == pytest.approx(rows["off"]["loss"], abs=1e-5)
    assert rows["decoupled"]["correction/rejected_frac"] == 0.0
    assert rows["decoupled"]["correction/logprob_abs_diff_max"] < 1e-4
    assert rows["bypass"]["correction/rejected_frac"] == pytest.approx(0.5)
    assert "correction/k3_kl" not in rows["off"]


def test_lora_export_loads_in_diffusers(train_dict, tiny_sd3: Path) -> None:
    from diffusers import StableDiffusion3Pipeline

    recipe = recipe_from_dict(train_dict(trainer={"steps": 1, "sample_every": 0}))
    loop = local_loop(recipe, recipe.trainer.output_dir)
    loop.train()
    adapter = loop.learner.adapter
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    pipe.load_lora_weights(Path(recipe.trainer.output_dir) / "checkpoint" / "step_0001" / "lora")
    cfg = next(iter(pipe.transformer.peft_config.values()))
    assert (cfg.r, cfg.lora_alpha) == (recipe.lora.rank, recipe.lora.alpha)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 8, 8, generator=g)
    cond = adapter.encode(["a red square", "a blue circle"])
    kw = dict(
        hidden_states=x,
        encoder_hidden_states=cond["prompt_embeds"],
        pooled_projections=cond["pooled_prompt_embeds"],
        timestep=torch.tensor([500.0, 500.0]),
        return_dict=False,
    )
    with torch.no_grad():
        ours = adapter.model(**kw)[0]
        theirs = pipe.transformer(**kw)[0]
        with adapter.disabled_adapters():
            base = adapter.model(**kw)[0]
    assert not torch.allclose(ours, base)  # the trained LoRA does something
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_kl_to_reference(train_dict) -> None:
    rows = train(recipe_from_dict(train_dict(algorithm={"kl_beta": 0.5}, trainer={"steps": 2})))
    assert rows[0]["actor/kl_ref"] == 0.0  # LoRA B starts at zero: the policy is the reference
    assert rows[1]["actor/kl_ref"] > 0.0
    d = train_dict(algorithm={"kl_beta": 0.5})
    d["lora"] = {"enabled": False}
    with pytest.raises(RecipeError, match=re.escape("kl_beta > 0 needs lora.enabled")):
        recipe_from_dict(d)


def test_ema_weights_and_exact_resume(train_dict, tmp_path: Path, monkeypatch) -> None:
    common = {"steps": 3, "save_every": 1, "sample_every": 0, "val_every": 1}
    opt = {"ema_decay": 0.5}
    full_recipe = recipe_from_dict(
        train_dict(trainer={**common, "output_dir": str(tmp_path / "full")}, optimizer=opt)
    )
    loop = local_loop(full_recipe, full_recipe.trainer.output_dir)
    loop.train()
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")  # with the step-0 baseline row
    ema = loop.learner.adapter.adapter_state("ema")
    live = loop.learner.adapter.adapter_state("default")
    assert any(not torch.equal(ema[k], live[k]) for k in live)  # the EMA lags the weights
    assert "ema/" + next(iter(live)) in load_file_keys(tmp_path / "full")

    run = tmp_path / "cut"
    rec = recipe_from_dict(train_dict(trainer={**common, "output_dir": str(run)}, optimizer=opt))
    orig = DiffusionLoop.train_step

    def dying(self, step, rollout):
        if step == 2:
            raise KeyboardInterrupt
        return orig(self, step, rollout)

    monkeypatch.setattr(DiffusionLoop, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        train(rec)
    monkeypatch.setattr(DiffusionLoop, "train_step", orig)
    resume(run)
    assert without_timings(read_metrics(run / "metrics.jsonl")) == without_timings(full)


def load_file_keys(run: Path) -> set[str]:
    from safetensors import safe_open

    path = run / "checkpoint" / "step_0003" / "trainable.safetensors"
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def test_sync_step_computes_in_one_thread_team(train_dict, tmp_path, monkeypatch):
    """trainer.mode sync, reward.overlap: every wave runs in the main thread (the one that
    also runs the update), no scheduler thread starts, and the reward thread runs torch on
    one thread, so the process holds one OpenMP team (docs/performance.md)."""
    import threading

    import torch

    import omni_rewards
    from diffusion_rollout.engine import EmbeddedEngine

    reward_threads: list[tuple[str, int]] = []

    class Seen(omni_rewards.Reward):
        name = "seen_brightness"

        def __init__(self) -> None:
            super().__init__()
            self.inner = omni_rewards.load_reward("brightness")

        def score_batch(self, inp):
            reward_threads.append((threading.current_thread().name, torch.get_num_threads()))
            return self.inner(inp)

    monkeypatch.setitem(omni_rewards.REWARDS, "seen_brightness", Seen)
    wave_threads: list[threading.Thread] = []
    run_wave = EmbeddedEngine._run_wave

    def seen_wave(self, entries):
        wave_threads.append(threading.current_thread())
        assert not [t for t in threading.enumerate() if t.name == "diffusion-rollout-scheduler"]
        run_wave(self, entries)

    monkeypatch.setattr(EmbeddedEngine, "_run_wave", seen_wave)
    d = train_dict(
        reward={"name": "seen_brightness", "overlap": True},
        rollout={"max_num_seqs": 2},
        trainer={"steps": 1, "sample_every": 0, "threads": 2},
    )
    (row,) = train(recipe_from_dict(d))
    assert np.isfinite(row["loss"])
    assert len(wave_threads) >= 4 and set(wave_threads) == {threading.main_thread()}
    assert {n for _, n in reward_threads} == {1}
    assert {name.split("_")[0] for name, _ in reward_threads} == {"reward"}


def test_reward_overlaps_the_rollout_and_scores_the_same(train_dict, tmp_path, monkeypatch):
    """reward.overlap: each wave is scored while the next waves compute (4 waves of 2 rows
    here), with the rewards of scoring the whole batch after the rollout. Its default,
    `auto`, scores after the rollout here: rollout and reward both on the CPU."""
    import time as _time

    import omni_rewards

    calls: list[tuple[float, int]] = []

    class Timed(omni_rewards.Reward):
        name = "timed_brightness"

        def __init__(self) -> None:
            super().__init__()
            self.inner = omni_rewards.load_reward("brightness")

        def score_batch(self, inp):
            calls.append((_time.monotonic(), len(inp)))
            return self.inner(inp)

    monkeypatch.setitem(omni_rewards.REWARDS, "timed_brightness", Timed)
    from diffusion_rollout.engine import EmbeddedEngine

    wave_ends: list[float] = []
    run_wave = EmbeddedEngine._run_wave

    def timed_wave(self, entries):
        run_wave(self, entries)
        wave_ends.append(_time.monotonic())

    monkeypatch.setattr(EmbeddedEngine, "_run_wave", timed_wave)
    rows = {}
    for overlap in (False, True, "auto"):
        calls.clear()
        wave_ends.clear()
        d = train_dict(
            reward={"name": "timed_brightness", "overlap": overlap},
            rollout={"max_num_seqs": 2},
            trainer={"steps": 1, "sample_every": 0, "output_dir": str(tmp_path / str(overlap))},
        )
        rows[overlap] = train(recipe_from_dict(d))[0]
        if overlap is True:
            sizes = [n for _, n in calls]
            assert sizes == [2, 2, 2, 2], sizes  # one call per wave
            assert len(wave_ends) >= 4
            assert calls[0][0] < wave_ends[3]  # scoring began while waves were still running
        else:
            assert [n for _, n in calls] == [8]
    for k in ("reward/mean", "reward/std", "loss"):
        assert rows[True][k] == pytest.approx(rows[False][k], abs=1e-7), k
        assert rows["auto"][k] == rows[False][k], k
    # the rollout logs the same metrics whichever way it ran
    assert set(rows[True]) == set(rows[False]) == set(rows["auto"])
    for overlap, row in rows.items():
        assert 0 < row["timing/rollout_busy_s"] <= row["timing/rollout_s"] + 1e-3, overlap


HTTP_REWARD = {"name": "http", "options": {"url": "http://127.0.0.1:1"}}


@pytest.mark.parametrize(
    ("overrides", "threads", "expected"),
    [
        ({}, 2, False),  # `auto`: rollout and reward on the CPU
        ({}, 1, False),  # even with a core left free
        ({"reward": {"overlap": True}}, 2, True),
        ({"model": {"device": "cuda"}}, 2, True),  # the CPU is free while the GPU rolls out
        ({"reward": HTTP_REWARD}, 1, True),  # a reward that waits, and a core for its thread
        ({"reward": HTTP_REWARD}, 2, False),  # beside torch threads on every core
        (
            {
                "reward": {
                    "name": None,
                    "terms": [{"name": "http"}, {"name": "brightness", "weight": 0.5}],
                }
            },
            1,
            False,  # one term computes on the CPU
        ),
        ({"trainer": {"mode": "async"}, "model": {"device": "cuda"}}, 1, False),
        ({"reward": {"inputs": ["media", "audio"]}, "model": {"device": "cuda"}}, 1, False),
    ],
)
def test_reward_overlap_auto_follows_where_the_reward_computes(
    train_dict, overrides, threads, expected
) -> None:
    """On 2 cores, the rollout on `threads` torch threads."""
    from omni_train.loops.diffusion import reward_overlaps

    d = train_dict()
    for section, values in overrides.items():
        d[section] = {**d.get(section, {}), **values}
    assert reward_overlaps(recipe_from_dict(d), threads, cores=2) is expected


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"trainer": {"mode": "async"}}, "trainer.mode async"),
        ({"reward": {"inputs": ["media", "audio"]}}, "audio in reward.inputs"),
        ({"rollout": {"backend": "http", "url": "http://127.0.0.1:1"}}, "rollout.backend http"),
        ({"trainer": {"backend": "ray"}}, "trainer.backend ray"),
    ],
)
def test_reward_overlap_true_is_refused_where_it_cannot_run(train_dict, overrides, named):
    """`reward.overlap: true` where no rollout hands the loop its waves: an error naming the
    key and why, not a setting silently ignored; `auto` runs there."""
    d = train_dict(reward={"overlap": True})
    for section, values in overrides.items():
        d[section] = {**d.get(section, {}), **values}
    with pytest.raises(RecipeError, match=re.escape("reward.overlap: true")) as exc:
        recipe_from_dict(d)
    assert named in str(exc.value)
    d["reward"]["overlap"] = "auto"
    recipe_from_dict(d)


def test_cps_rollout_replays_and_epochs_take_an_optimizer_step_each(train_dict, tmp_path) -> None:
    """Through the whole loop: CPS log-probs (`rollout.sde_kind: cps`) are the ones the update
    recomputes, and `algorithm.epochs: 2` passes over the batch twice, one AdamW step each
    (the checkpoint's optimizer state counts them)."""
    from safetensors.torch import load_file

    d = train_dict(
        rollout={"sde_kind": "cps"},
        algorithm={"epochs": 2, "clip_range": 0.2},
        trainer={"steps": 1, "save_every": 1, "sample_every": 0},
    )
    recipe = recipe_from_dict(d)
    (row,) = train(recipe)
    assert row["rollout/logprob_diff_max"] < 1e-4 and np.isfinite(row["loss"])
    moments = load_file(
        Path(recipe.trainer.output_dir) / "checkpoint/step_0001/optimizer.safetensors"
    )
    steps = {float(v) for k, v in moments.items() if k.endswith(".step")}
    assert steps == {2.0}, steps
