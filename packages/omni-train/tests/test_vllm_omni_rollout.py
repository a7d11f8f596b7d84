"""rollout.backend: vllm-omni from omni-train, end to end: the run starts its `VllmOmniEngine`
with the LoRA config and `rollout.max_num_seqs`, pushes each step's LoRA through vllm-omni's
worker RPC, and gets the embedded engine's trajectories, so the same rewards and updates: on
the local backend (sync and async) and under `trainer.backend: ray`.

vllm-omni's GPU executor cannot run on this machine: the engine's ``AsyncOmni`` is replaced by
`diffusion_rollout.vllm_inprocess.in_process_omni`, built from the very arguments the run
passes (`VllmOmniEngine._make_omni`, the one seam), which serves requests with vllm-omni's own
engine config, model loader, request batch, output check, post-process and worker extension.

Runs in the lock's vllm-omni environment (``nox -s tests-vllm-omni``, which installs omni-train
there without its dependencies); skipped where vllm-omni is not installed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm_omni.diffusion.data")

from omni_train_testutils import minimal_recipe

from omni_train import train
from omni_train.recipe import recipe_from_dict


def _recipe(tmp, model) -> dict:
    d = minimal_recipe(tmp, model, steps=3)
    d["rollout"].update({"sde_window_range": [0, 3], "noise_level": 0.8, "max_num_seqs": 8})
    # the setting for an engine apart from the trainer: the trainer recomputes the log-probs
    # and weights each sample by how far the engine's are from its own
    d["algorithm"] = {"name": "flow_grpo", "clip_range": 0.2, "rollout_correction": "decoupled"}
    d["lora"] = {"rank": 4, "alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}
    d["optimizer"] = {"lr": 2e-2}
    return d


@pytest.fixture
def started(monkeypatch) -> list:
    """Every `VllmOmniEngine` a run starts gets an in-process ``AsyncOmni`` built from the
    arguments the run gave it; the list collects ``(kwargs, omni)`` per engine."""
    import omni_train.loops.run as run_module
    from diffusion_rollout import VllmOmniEngine
    from diffusion_rollout.vllm_inprocess import in_process_omni

    # this environment holds diffusion-rollout's dependencies, not matplotlib: no reward curve
    monkeypatch.setattr(run_module, "plot_reward_curve", lambda *a, **k: None)
    engines: list = []

    async def make_omni(self, kwargs):
        engines.append((kwargs, in_process_omni(**kwargs)))
        return engines[-1][1]

    monkeypatch.setattr(VllmOmniEngine, "_make_omni", make_omni)
    return engines


def _on_vllm_omni(d: dict):
    recipe = recipe_from_dict(d)
    # The recipe refuses vllm-omni without model.device cuda (its executor needs a GPU); the
    # in-process engine does not, so the backend is set after that check.
    recipe.rollout.backend = "vllm-omni"
    return recipe


def test_a_run_on_vllm_omni_trains_like_the_embedded_engine(tmp_path, tiny_sd3, started):
    from diffusion_rollout.vllm_backend import LOAD_METHOD, PIPELINE_CLASS

    embedded = train(recipe_from_dict(_recipe(tmp_path / "e", tiny_sd3)))
    served = train(_on_vllm_omni(_recipe(tmp_path / "v", tiny_sd3)))

    (kwargs, omni), *more = started
    assert not more  # one engine for the run
    assert kwargs["model"] == str(tiny_sd3) and kwargs["max_num_seqs"] == 8
    lora = kwargs["custom_pipeline_args"]["lora"]  # the adapter is added when the engine loads
    assert kwargs["custom_pipeline_args"]["pipeline_class"] == PIPELINE_CLASS
    assert (lora["rank"], lora["alpha"]) == (4, 8.0)
    assert sorted(lora["target_modules"]) == ["to_k", "to_out.0", "to_q", "to_v"]
    # each step's LoRA went through the worker RPC and the next rollout ran on it
    assert omni.rpcs.count(LOAD_METHOD) >= 2
    assert [r["weights/version"] for r in served] == [1, 2, 3]
    assert [r["rollout/version"] for r in served] == [0, 1, 2]
    for a, b in zip(embedded, served, strict=True):
        for k in ("reward/mean", "reward/std", "loss", "actor/grad_norm"):
            assert b[k] == pytest.approx(a[k], abs=1e-5), (k, a[k], b[k])
        assert b["correction/logprob_abs_diff_max"] < 1e-4
        assert b["correction/rejected_frac"] == 0.0
    assert served[-1]["reward/mean"] != served[0]["reward/mean"]  # the pushed LoRA is in use


def test_async_mode_on_vllm_omni_trains_like_the_embedded_engine(tmp_path, tiny_sd3, started):
    """`trainer.mode: async`: step k+1 rolls out on the engine while step k updates, and the
    run (staleness, corrections, rewards, losses) is the embedded engine's async run."""

    def recipe_dict(name: str) -> dict:
        d = _recipe(tmp_path / name, tiny_sd3)
        d["algorithm"]["rollout_correction"] = "off"  # stale samples get async_correction
        d["trainer"].update({"mode": "async", "max_staleness": 1, "threads": 1})
        return d

    embedded = train(recipe_from_dict(recipe_dict("e")))
    served = train(_on_vllm_omni(recipe_dict("v")))
    assert len(started) == 1
    assert [r["async/staleness_max"] for r in served] == [0.0, 1.0, 1.0]
    assert [r["rollout/version"] for r in served] == [0, 0, 1]
    assert "correction/is_weight_mean" in served[1]  # the stale samples were corrected
    for a, b in zip(embedded, served, strict=True):
        for k in ("reward/mean", "loss", "actor/grad_norm", "correction/is_weight_mean"):
            if k in a or k in b:
                assert b[k] == pytest.approx(a[k], abs=1e-5), (k, a.get(k), b.get(k))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_ray_run_on_vllm_omni_trains_like_the_embedded_engine(
    tmp_path, tiny_sd3, started, ray_session
):
    """`trainer.backend: ray` with the vllm-omni rollout: two FSDP ranks on Ray train, the
    driver starts the one engine, and each step's LoRA, gathered from the ranks' shards, goes
    through vllm-omni's worker RPC; the run is the local embedded engine's."""
    from diffusion_rollout.vllm_backend import LOAD_METHOD

    def recipe_dict(name: str) -> dict:
        d = _recipe(tmp_path / name, tiny_sd3)
        # Adam's first step is lr * g / (|g| + eps): eps 1e-4 keeps the ranks' reduction order
        # (2 ranks vs 1 process) from showing up as a weight difference, and lr 0.5 still moves
        # the policy enough that an engine one LoRA behind would read log-probs 1e-3 apart
        # (measured with trainer.mode async, max_staleness 1), ten times the bound below
        d["optimizer"] = {"lr": 0.5, "eps": 1e-4}
        return d

    embedded = train(recipe_from_dict(recipe_dict("e")))
    on_ray = recipe_dict("r")
    on_ray["trainer"].update({"backend": "ray", "num_workers": 2})
    served = train(_on_vllm_omni(on_ray))

    (kwargs, omni), *more = started
    assert not more and kwargs["model"] == str(tiny_sd3)
    assert omni.rpcs.count(LOAD_METHOD) >= 2
    assert [r["weights/version"] for r in served] == [1, 2, 3]
    assert [r["rollout/version"] for r in served] == [0, 1, 2]
    for a, b in zip(embedded, served, strict=True):
        for k in ("reward/mean", "reward/std", "loss", "actor/grad_norm", "actor/ratio_std"):
            assert b[k] == pytest.approx(a[k], abs=1e-4), (k, a[k], b[k])
        assert b["correction/logprob_abs_diff_max"] < 1e-4
    assert served[-1]["reward/mean"] != served[0]["reward/mean"]


def test_the_engine_loads_the_model_as_the_trainer_does(tmp_path, tiny_sd3, started):
    """The run hands vllm-omni the trainer's `model.dtype` (vLLM's dtype, which its worker
    loads the denoiser with) and `model.options` (the denoiser's options)."""
    from omni_train.backends.remote_rollout import make_remote_rollout

    d = _recipe(tmp_path, tiny_sd3)
    d["model"].update(dtype="bfloat16", options={"gradient_checkpointing": True})
    make_remote_rollout(_on_vllm_omni(d), tiny_sd3, None).close()
    ((kwargs, _),) = started
    assert kwargs["dtype"] == "bfloat16"
    assert kwargs["custom_pipeline_args"]["denoiser_options"] == {"gradient_checkpointing": True}
