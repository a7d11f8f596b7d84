"""`algorithm.timestep_sampling`: where the forward-process losses (DiffusionNFT, online DPO)
re-noise their clean samples."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from omni_train.updates import UpdateSettings
from omni_train.updates.forward_process import training_t


def _ctx(adapter, sampling: str, t_range=(0.0, 1.0)) -> SimpleNamespace:
    settings = UpdateSettings(timestep_sampling=sampling, timestep_range=t_range)
    return SimpleNamespace(adapter=adapter, settings=settings)


def test_schedule_sampling_trains_at_the_samplers_own_timesteps(tiny_sd3: Path) -> None:
    """`schedule` maps a draw u in [lo, hi] to one of the rollout schedule's sigmas in
    [lo, hi] (the model's shift included), each equally likely: u = lo the noisiest, u -> hi
    the cleanest; `uniform` keeps the draws."""
    from diffusion_rollout import SamplingParams
    from omni_adapters import from_pretrained

    adapter = from_pretrained(tiny_sd3)
    params = SamplingParams(num_steps=8, height=32, width=32)
    sigmas = adapter.sigmas(params)[:-1]
    assert sigmas[0] == pytest.approx(1.0) and len(sigmas) == 8
    assert (sigmas[1:] < sigmas[:-1]).all()
    u = torch.tensor([[0.0, 0.124, 0.125, 0.5, 0.999], [0.3, 0.6, 0.7, 0.8, 0.9]])
    t = training_t(_ctx(adapter, "schedule"), u, params)
    assert t.shape == u.shape
    assert torch.equal(t, sigmas[(u * 8).long()])
    assert t[0, 0] == sigmas[0] and t[0, 4] == sigmas[7]
    # a range keeps its meaning: only the sigmas inside it, spread over the draws of it
    lo, hi = 0.5, 1.0
    inside = sigmas[(sigmas >= lo) & (sigmas <= hi)]
    assert 1 < len(inside) < len(sigmas)
    u = lo + (hi - lo) * torch.rand(2, 200, generator=torch.Generator().manual_seed(0))
    t = training_t(_ctx(adapter, "schedule", (lo, hi)), u, params)
    assert set(t.unique().tolist()) == set(inside.tolist())
    assert training_t(_ctx(adapter, "uniform"), u, params) is u
    with pytest.raises(ValueError, match=r"algorithm\.timestep_range"):
        training_t(_ctx(adapter, "schedule", (0.001, 0.002)), torch.full((1, 2), 0.0015), params)


@pytest.mark.slow
def test_nft_with_schedule_timesteps_runs_end_to_end(tmp_path: Path, tiny_sd3: Path) -> None:
    """A DiffusionNFT run of the tiny recipe with `timestep_sampling: schedule`: its logged
    mean training t is the mean of schedule sigmas, not of the uniform draws."""
    from omni_train import train
    from omni_train.recipe import load_recipe

    repo = Path(__file__).resolve().parents[3]
    recipe = load_recipe(
        repo / "recipes" / "tiny" / "sd3_brightness_flowgrpo.yaml",
        [
            f"model.path={tiny_sd3}",
            f"trainer.output_dir={tmp_path / 'nft'}",
            "algorithm.name=diffusion_nft",
            "algorithm.clip_range=null",  # the tiny recipe's; DiffusionNFT has no ratio clip
            "algorithm.timestep_sampling=schedule",
            "rollout.sde_kind=ode",
            "trainer.steps=2",
            "trainer.progress=false",
            "trainer.val_every=0",
            "trainer.save_every=0",
            "trainer.sample_every=0",
        ],
    )
    rows = train(recipe)
    assert len(rows) == 2
    # the tiny model's schedule (shift 3) puts every t at or above the unshifted value; the
    # uniform draws average 0.5, the schedule's steps well above it
    assert all(row["actor/t_mean"] > 0.55 for row in rows), [r["actor/t_mean"] for r in rows]
