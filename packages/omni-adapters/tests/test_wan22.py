"""Wan 2.2 specifics: video latent shape rules, per-token timesteps, two-expert refusal."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import omni_adapters
from omni_adapters.testing import Params, euler_sample, generators


@pytest.fixture()
def wan(tiny_path):
    return omni_adapters.from_pretrained(tiny_path("wan22"))


def test_video_latent_shape_and_validation(wan):
    assert wan.latent_shape(Params(num_frames=5)) == (48, 3, 4, 4)
    assert wan.latent_shape(Params(num_frames=1)) == (48, 1, 4, 4)
    with pytest.raises(ValueError, match="num_frames"):
        wan.latent_shape(Params(num_frames=4))
    with pytest.raises(ValueError, match="height"):
        wan.latent_shape(Params(height=24, num_frames=5))


def test_expand_timesteps_gives_one_timestep_per_token(wan):
    seen = {}

    def hook(module, args, kwargs):
        seen["t"] = kwargs["timestep"]

    p = Params(num_frames=5)
    c = wan.encode(["a cat walking", "rain"])
    x = wan.init_latents(2, p, generators([0, 1]))
    h = wan.model.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        wan.velocity(x, torch.tensor([0.5, 0.25]), c, p)
    h.remove()
    assert seen["t"].shape == (2, 3 * 2 * 2)
    torch.testing.assert_close(seen["t"][:, 0], torch.tensor([500.0, 250.0]))


def test_prompt_embeds_zero_after_valid_tokens(wan):
    c = wan.encode(["ab"])
    e = c["prompt_embeds"][0]
    assert e.shape == (16, 32)
    n = int((e.abs().sum(-1) > 0).sum())
    assert 0 < n < 16 and e[n:].abs().sum() == 0


def test_sigmas_static_shift_5(wan):
    s = wan.sigmas(Params(num_steps=4))
    shift = lambda t: 5 * t / (1 + 4 * t)  # noqa: E731
    t = torch.linspace(1.0, shift(1e-3), 4, dtype=torch.float64)
    torch.testing.assert_close(s[:-1], shift(t).float())


def test_two_expert_checkpoint_needs_boundary_ratio(tiny_path, tmp_path):
    root = tmp_path / "a14b"
    shutil.copytree(tiny_path("wan22_a14b"), root)
    index = json.loads((root / "model_index.json").read_text())
    index["boundary_ratio"] = None
    (root / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="boundary_ratio"):
        omni_adapters.from_pretrained(root)


def test_a14b_routes_each_row_to_its_expert(tiny_path):
    a = omni_adapters.from_pretrained(tiny_path("wan22_a14b"))
    high, low = a.experts
    calls = []
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, args, kw, n=n: calls.append((n, kw["hidden_states"].shape[0])),
            with_kwargs=True,
        )
        for n, m in (("high", high), ("low", low))
    ]
    p = Params(num_frames=5)
    c = a.encode(["a", "b", "c"])
    x = a.init_latents(3, p, generators([0, 1, 2]))
    sig = torch.tensor([0.95, 0.5, 0.875])  # boundary 0.875 * 1000 goes to the high expert
    with torch.no_grad():
        v = a.velocity(x, sig, c, p)
        v1 = a.velocity(x[1:2], sig[1:2], {k: t[1:2] for k, t in c.items()}, p)
    for h in hooks:
        h.remove()
    assert calls[:2] == [("high", 2), ("low", 1)]
    torch.testing.assert_close(v[1:2], v1, atol=1e-6, rtol=1e-6)
    n = a.add_lora(4)
    assert n == 2 * omni_adapters.from_pretrained(tiny_path("wan22")).add_lora(4)
    names = list(a.export_rollout_weights())
    assert any(k.startswith("transformer.blocks.") for k in names)
    assert any(k.startswith("transformer_2.blocks.") for k in names)


def test_a14b_matches_the_diffusers_pipeline(tiny_path):
    from diffusers import WanPipeline

    a = omni_adapters.from_pretrained(tiny_path("wan22_a14b"))
    p = Params(num_steps=4, guidance_scale=3.0, num_frames=5)
    assert (a.sigmas(p)[:-1] * 1000 >= 875).tolist() == [True, False, False, False]
    x0 = a.init_latents(1, p, generators([0]))
    ours = euler_sample(a, p, ["a red cube"], x0)
    pipe = WanPipeline.from_pretrained(tiny_path("wan22_a14b"))
    ref = pipe(
        "a red cube",
        negative_prompt="",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=4,
        guidance_scale=3.0,
        latents=x0.clone(),
        max_sequence_length=16,
        output_type="latent",
    ).frames
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_matches_the_diffusers_pipeline(tiny_path, wan):
    from diffusers import WanPipeline

    p = Params(num_steps=3, guidance_scale=3.0, num_frames=5)
    x0 = wan.init_latents(1, p, generators([0]))
    ours = euler_sample(wan, p, ["a red cube"], x0)
    pipe = WanPipeline.from_pretrained(tiny_path("wan22"))
    ref = pipe(
        "a red cube",
        negative_prompt="",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=3,
        guidance_scale=3.0,
        latents=x0.clone(),
        max_sequence_length=16,
        output_type="latent",
    ).frames
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
