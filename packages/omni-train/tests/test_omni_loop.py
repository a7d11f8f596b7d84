"""The omni (autoregressive) loop: GSPO/GRPO on the tiny Qwen3-Omni thinker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_train.errors import TrainError
from omni_train.omni_loop import OmniTrainer, k3_kl
from omni_train.plots import read_metrics
from omni_train.recipe import RecipeError, recipe_from_dict
from omni_train.trainer import TIMING_PREFIXES, resume, train


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


def _det(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def test_k3_kl_zero_at_equal_and_positive_otherwise() -> None:
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[True, True, False]])
    assert float(k3_kl(lp, lp.clone(), mask)) == pytest.approx(0.0, abs=1e-7)
    ref = lp + torch.tensor([[0.5, -0.5, 100.0]])  # the masked token must not count
    d = torch.tensor([0.5, -0.5])
    expect = float((torch.exp(d) - d - 1).mean())
    assert float(k3_kl(lp, ref, mask)) == pytest.approx(expect, rel=1e-6)


def test_two_gspo_steps_write_metrics_and_replay_matches(tiny_thinker, tmp_path: Path) -> None:
    recipe = recipe_from_dict(_omni_dict(tmp_path, tiny_thinker))
    assert recipe.is_omni()
    t = OmniTrainer(recipe)
    t.setup()
    before = {k: v.detach().clone() for k, v in t.params_named.items()}
    rows = t.train()
    assert [r["step"] for r in rows] == [0, 1]
    on_disk = read_metrics(Path(recipe.trainer.output_dir) / "metrics.jsonl")
    assert _det(on_disk) == _det(rows)
    for key in ("reward/mean", "loss", "actor/grad_norm", "rollout/logprob_abs_diff_max"):
        assert key in on_disk[0], key
    # minibatch 0 replays the responses on the rollout weights: the log-probs agree
    assert on_disk[0]["rollout/logprob_abs_diff_max"] < 1e-4
    assert "val/reward_mean" in on_disk[1]
    changed = [k for k, v in t.params_named.items() if not torch.equal(v, before[k])]
    assert changed, "the update changed no LoRA parameter"
    run = Path(recipe.trainer.output_dir)
    assert (run / "reward_curve.png").is_file()
    assert (run / "checkpoint" / "step_0002" / "state.json").is_file()


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
    orig = OmniTrainer.train_step

    def dying(self, step, logger):
        row = orig(self, step, logger)
        if step == 1:
            raise KeyboardInterrupt
        return row

    monkeypatch.setattr(OmniTrainer, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        train(recipe)
    monkeypatch.setattr(OmniTrainer, "train_step", orig)
    resume(run)
    resumed = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert _det(resumed) == _det(full)


def test_constrained_decoding_rollout_matches_replay(tiny_thinker, tmp_path: Path) -> None:
    """`rollout.allowed_tokens`: rollout and validation emit only the allowed letters, and the
    replay of the masked distribution reproduces the rollout log-probs (< 1e-4)."""
    d = _omni_dict(tmp_path, tiny_thinker, rollout={"allowed_tokens": ["A", "B", "C", "D"]})
    t = OmniTrainer(recipe_from_dict(d))
    rows = t.train()
    for row in rows:
        assert row["rollout/logprob_abs_diff_max"] < 1e-4, row["rollout/logprob_abs_diff_max"]
    assert all(set(text) <= set("ABCD") for text in t._val_texts)
    batch = t.rollout(5)
    assert all(set(text) <= set("ABCD") for text in batch.texts)
    assert set(batch.tokens[batch.mask].tolist()) <= set(t.allowed_ids or [])
    # without the mask in the replay the log-probs differ: the mask is what is trained
    prompt = t._build(batch.items)
    rb = {
        **prompt,
        "responses": batch.tokens,
        "response_mask": batch.mask,
        "temperature": batch.temperature,
    }
    with torch.no_grad():
        free = t.adapter.token_log_probs(rb)
        masked = t.adapter.token_log_probs({**rb, "allowed_tokens": t.allowed_ids})
    assert (masked - batch.log_probs).abs().max() < 1e-4
    assert (masked - free)[batch.mask].min() > 1e-3


def test_allowed_tokens_error_names_the_field(tiny_thinker, tmp_path: Path) -> None:
    d = _omni_dict(tmp_path, tiny_thinker, rollout={"allowed_tokens": ["A", ""]})
    with pytest.raises(RecipeError, match=r"rollout\.allowed_tokens: '' "):
        OmniTrainer(recipe_from_dict(d)).setup()
    d = _omni_dict(tmp_path, tiny_thinker, rollout={"allowed_tokens": ["<|image_pad|>"]})
    with pytest.raises(RecipeError, match=r"rollout\.allowed_tokens: .*cannot emit"):
        OmniTrainer(recipe_from_dict(d)).setup()


def test_omni_errors_name_the_field(tiny_thinker, tmp_path: Path) -> None:
    d = _omni_dict(tmp_path, tiny_thinker)
    d["data"] = {"prompts": ["no answers here"], "prompts_per_step": 1}
    with pytest.raises((RecipeError, TrainError), match="data"):
        train(recipe_from_dict(d))
    d = _omni_dict(tmp_path, tiny_thinker, algorithm={"name": "flow_grpo"})
    with pytest.raises((RecipeError, TrainError, ValueError), match=r"algorithm\.name"):
        train(recipe_from_dict(d))
