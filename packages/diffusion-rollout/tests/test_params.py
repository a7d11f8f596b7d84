"""SamplingParams / RolloutRequest validation and compatibility keys."""

from __future__ import annotations

import dataclasses

import pytest

from diffusion_rollout import RolloutRequest, SamplingParams


def test_frozen_and_hashable():
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.height = 3
    assert hash(p) == hash(SamplingParams())


def test_compat_key_fields():
    base = SamplingParams(height=64, width=64, num_steps=4)
    same = [
        base.replace(noise_level=0.3),
        base.replace(sde_kind="cps"),
        base.replace(sde_window_size=2),
        base.replace(sde_window_range=(1, 3)),
    ]
    for p in same:
        assert p.compat_key() == base.compat_key()
    differ = dict(
        height=32,
        width=32,
        num_frames=5,
        num_steps=6,
        guidance_scale=4.5,
        true_cfg_scale=2.0,
        output="latent",
        weights_version=3,
    )
    for name, value in differ.items():
        assert base.replace(**{name: value}).compat_key() != base.compat_key(), name


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(height=0), "height"),
        (dict(num_steps=2.5), "num_steps"),
        (dict(guidance_scale=float("nan")), "guidance_scale"),
        (dict(noise_level=-1), "noise_level"),
        (dict(sde_kind="euler"), "sde_kind"),
        (dict(output="png"), "output"),
        (dict(sde_window_size=0), "sde_window_size"),
        (dict(num_steps=4, sde_window_size=5), "sde_window_size"),
        (dict(num_steps=4, sde_window_range=(2, 9)), "sde_window_range"),
        (dict(sde_window_range=(1,)), "sde_window_range"),
        (dict(weights_version=-2), "weights_version"),
    ],
)
def test_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_dict_round_trip():
    p = SamplingParams(height=32, sde_window_size=2, sde_window_range=(1, 5), weights_version=4)
    assert SamplingParams.from_dict(p.to_dict()) == p
    r = RolloutRequest("a cat", 5, p, "id1", negative_prompt="blur")
    assert RolloutRequest.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="seed"):
        RolloutRequest.from_dict({"prompt": "x"})
    with pytest.raises(ValueError, match="seed"):
        RolloutRequest("x", seed="3")
    with pytest.raises(ValueError, match="prompt"):
        RolloutRequest(3, seed=1)
