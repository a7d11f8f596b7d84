"""BAGEL family: own module definition, tiny build, load, Denoiser, LoRA, replay, sync."""

from __future__ import annotations

import pytest
import torch
from release_fixtures import BAGEL_TINY, bagel_ema_shapes, flux_ae_shapes

import omni_adapters
from omni_adapters.checkpoints import safetensors_keys
from omni_adapters.families.bagel import Bagel, BagelAdapter, BagelConfig
from omni_adapters.testing import Params, generators, pearson, perturb_lora, rollout_vs_replay

FAMILY = "bagel"
#: where omni_adapters.tiny.build("bagel") differs from the fixture's sizes
TINY_BUILD_SIZES = {
    "inter": 64,
    "vit_inter": 32,
    "vit_layers_in_config": 2,
    "latent_grid": 16,
}
P = Params(height=32, width=32, num_steps=3)


@pytest.fixture(scope="module")
def bagel_path(tiny_path):
    return tiny_path(FAMILY)


@pytest.fixture(scope="module")
def bagel(bagel_path):
    a = omni_adapters.from_pretrained(bagel_path)
    a.add_lora(rank=4)
    perturb_lora(a, seed=0, scale=0.05)
    return a


def test_build_writes_the_released_layout(bagel_path):
    names = {p.name for p in bagel_path.iterdir()}
    assert {"llm_config.json", "vit_config.json", "ema.safetensors", "ae.safetensors"} <= names
    assert not list(bagel_path.rglob("*.bin")) and not list(bagel_path.rglob("*.pkl"))
    keys = set(safetensors_keys(bagel_path / "ema.safetensors"))
    # the official module tree's names (ByteDance-Seed/Bagel modeling/bagel)
    assert keys == set(bagel_ema_shapes({**BAGEL_TINY, **TINY_BUILD_SIZES}))
    assert keys_of_ae(bagel_path) == set(flux_ae_shapes({**BAGEL_TINY, "ae_blocks": 1}))


def keys_of_ae(path):
    return set(safetensors_keys(path / "ae.safetensors"))


def test_config_needs_the_release_fields():
    with pytest.raises(ValueError, match=r"llm_config.json: missing fields \['vocab_size'"):
        BagelConfig.from_release({"hidden_size": 32}, {})


def test_from_pretrained_picks_bagel(bagel_path):
    a = omni_adapters.from_pretrained(bagel_path)
    assert isinstance(a, BagelAdapter) and a.family == FAMILY
    assert isinstance(a.model, Bagel)
    assert not a.trainable_parameters()
    assert 10_000 < sum(p.numel() for p in a.model.parameters()) < 200_000
    assert a.fsdp_wrap_units()[0].__name__ == "BagelMoTDecoderLayer"


def test_lora_binds_generation_expert(bagel_path):
    a = omni_adapters.from_pretrained(bagel_path)
    assert a.add_lora(rank=2) == 2 * 4
    names = list(a.export_rollout_weights())
    assert all("_moe_gen.lora_" in k for k in names)
    with pytest.raises(ValueError, match="binds 0 modules"):
        a.add_lora(rank=2, target_modules=["nope"], adapter_name="bad")


def test_experts_are_routed_by_token_type(bagel_path):
    # the generation expert only sees VAE-latent tokens: changing its MLP changes the
    # velocity but never the understanding (text) logits
    a = omni_adapters.from_pretrained(bagel_path)
    c = a.encode(["a red cube"])
    x = a.init_latents(1, P, generators([1]))
    s = a.sigmas(P)[1].expand(1)
    with torch.no_grad():
        v0 = a.velocity(x, s, c, P)
        lg0 = a.understand(["a red cube"])
        a.model.language_model.model.layers[0].mlp_moe_gen.down_proj.weight.add_(0.5)
        v1 = a.velocity(x, s, c, P)
        lg1 = a.understand(["a red cube"])
    assert (v0 - v1).abs().max() > 1e-5
    torch.testing.assert_close(lg0, lg1, rtol=0, atol=0)


def test_understanding_reads_images(bagel):
    img = torch.zeros(1, 3, 16, 16)
    with torch.no_grad():
        a = bagel.understand(["what is this?"], img)
        b = bagel.understand(["what is this?"], img + 0.5)
        t = bagel.understand(["what is this?"])
    assert a.shape == t.shape == (1, 16, 320)
    assert (a - b).abs().max() > 1e-6


def test_encode_and_latents(bagel):
    c = bagel.encode(["a cat", "a much longer prompt"])
    assert c["input_ids"].shape == (2, 16) and c["input_ids"].dtype == torch.int64
    assert c["negative_attention_mask"].sum() < c["attention_mask"].sum()
    x = bagel.init_latents(3, P, generators([5, 6, 7]))
    assert x.shape == (3, 4, 16, 16)
    y = bagel.init_latents(1, P, generators([6]))
    torch.testing.assert_close(x[1], y[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="height"):
        bagel.latent_shape(Params(height=30, width=32))


def test_sigmas_use_the_timestep_shift(bagel):
    s = bagel.sigmas(P)
    base = torch.tensor([1.0, 2 / 3, 1 / 3, 0.0])
    torch.testing.assert_close(s, 3 * base / (1 + 2 * base), atol=1e-6, rtol=0)


def test_one_denoise_step_and_decode(bagel):
    c = bagel.encode(["a cat", "rain"])
    x = bagel.init_latents(2, P, generators([1, 2]))
    s = bagel.sigmas(P)
    with torch.no_grad():
        v = bagel.velocity(x, s[0].expand(2), c, P)
        v_batch1 = bagel.velocity(x[1:], s[0].expand(1), {k: t[1:] for k, t in c.items()}, P)
    assert v.shape == x.shape and torch.isfinite(v).all()
    torch.testing.assert_close(v[1:], v_batch1, atol=1e-5, rtol=1e-5)  # rows independent
    img = bagel.decode(x + (s[1] - s[0]) * v)
    assert img.shape == (2, 32, 32, 3) and img.dtype == torch.uint8


def test_cfg_is_packed_guidance(bagel):
    c = bagel.encode(["a bird"])
    x = bagel.init_latents(1, P, generators([4]))
    s = bagel.sigmas(P)[0].expand(1)
    cfg = Params(height=32, width=32, num_steps=3, guidance_scale=4.0)
    pos = {k: v for k, v in c.items() if not k.startswith("negative_")}
    neg = {k: c["negative_" + k] for k in pos}
    with torch.no_grad():
        v = bagel.velocity(x, s, c, cfg)
        vp = bagel.velocity(x, s, pos, P)
        vn = bagel.velocity(x, s, neg, P)
    torch.testing.assert_close(v, vn + 4.0 * (vp - vn), atol=1e-5, rtol=1e-5)


def test_rollout_matches_replay(bagel):
    for params in (P, Params(height=32, width=32, num_steps=3, guidance_scale=3.0)):
        rollout, replay = rollout_vs_replay(bagel, params, ["a", "b c", "d e f", "g"], [1, 2, 3, 4])
        assert (rollout - replay).abs().max().item() <= 1e-5
        assert pearson(rollout, replay) >= 0.9999


def test_export_import_round_trip(bagel_path, bagel):
    w = bagel.export_rollout_weights()
    fresh = omni_adapters.from_pretrained(bagel_path)
    fresh.add_lora(rank=4)
    ck = omni_adapters.weights_checksum
    assert ck(fresh.export_rollout_weights()) != ck(w)
    fresh.load_weights(bagel.export_rollout_weights("vllm_omni"))
    assert ck(fresh.export_rollout_weights()) == ck(w)
    c = bagel.encode(["sync"])
    x = bagel.init_latents(1, P, generators([9]))
    s = bagel.sigmas(P)[0].expand(1)
    with torch.no_grad():
        torch.testing.assert_close(
            bagel.velocity(x, s, c, P), fresh.velocity(x, s, c, P), rtol=0, atol=0
        )


def test_build_is_deterministic(tmp_path, bagel_path):
    from safetensors.torch import load_file

    again = omni_adapters.tiny.build(FAMILY, tmp_path / "again", seed=0)
    other = omni_adapters.tiny.build(FAMILY, tmp_path / "other", seed=1)
    ck = omni_adapters.weights_checksum
    a = load_file(bagel_path / "ema.safetensors")
    assert ck(a) == ck(load_file(again / "ema.safetensors"))
    assert ck(a) != ck(load_file(other / "ema.safetensors"))


def test_gradient_checkpointing_gives_the_same_gradients(bagel_path):
    grads = []
    for ckpt in (False, True):
        a = omni_adapters.from_pretrained(bagel_path, gradient_checkpointing=ckpt)
        a.add_lora(rank=2)
        perturb_lora(a, seed=1)
        c = a.encode(["a cat"])
        x = a.init_latents(1, P, generators([2]))
        a.replay_velocity(x, a.sigmas(P)[1].expand(1), c, P).square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in a.trainable_parameters()]))
    assert a.model.language_model.model.gradient_checkpointing
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
