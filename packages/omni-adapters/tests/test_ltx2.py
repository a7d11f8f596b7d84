"""LTX-2 family: tiny build, load, joint video+audio Denoiser, LoRA, replay consistency, sync."""

from __future__ import annotations

import json

import pytest
import torch

import omni_adapters
from omni_adapters.families.ltx2 import (
    LTX23_CONNECTORS,
    LTX23_TRANSFORMER,
    LTX2Adapter,
    build_tiny_version,
)
from omni_adapters.testing import Params, generators, pearson, perturb_lora, rollout_vs_replay

FAMILY = "ltx2"
P = Params(height=16, width=16, num_frames=5, num_steps=3)


@pytest.fixture(scope="module")
def ltx_path(tiny_path):
    return tiny_path(FAMILY)


@pytest.fixture(scope="module")
def ltx(ltx_path):
    a = omni_adapters.from_pretrained(ltx_path)
    a.add_lora(rank=4)
    perturb_lora(a, seed=0, scale=0.05)
    return a


def test_build_writes_an_ltx2_pipeline_folder(ltx_path):
    index = json.loads((ltx_path / "model_index.json").read_text())
    assert index["_class_name"] == "LTX2Pipeline"
    assert index["transformer"] == ["diffusers", "LTX2VideoTransformer3DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLLTX2Video"]
    assert index["audio_vae"] == ["diffusers", "AutoencoderKLLTX2Audio"]
    assert index["vocoder"][1] == "LTX2Vocoder"
    assert index["text_encoder"] == ["transformers", "Gemma3ForConditionalGeneration"]
    assert not list(ltx_path.rglob("*.bin")) and not list(ltx_path.rglob("*.pkl"))
    # the LTX-2.3 flags of diffusers' conversion script (version "2.3")
    cfg = json.loads((ltx_path / "transformer" / "config.json").read_text())
    assert {k: cfg[k] for k in LTX23_TRANSFORMER} == LTX23_TRANSFORMER
    con = json.loads((ltx_path / "connectors" / "config.json").read_text())
    assert {k: con[k] for k in LTX23_CONNECTORS} == LTX23_CONNECTORS


def test_diffusers_itself_runs_the_tiny_folder(ltx_path):
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(ltx_path)
    out = pipe(
        prompt="a robot",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=1,
        guidance_scale=1.0,
        audio_guidance_scale=1.0,
        stg_scale=0.0,
        audio_stg_scale=0.0,
        modality_scale=1.0,
        audio_modality_scale=1.0,
        guidance_rescale=0.0,
        audio_guidance_rescale=0.0,
        max_sequence_length=16,
        output_type="pt",
    )
    assert out.frames.shape == (1, 5, 3, 32, 32)
    assert out.audio.shape[:2] == (1, 2)


def test_from_pretrained_picks_ltx2(ltx_path):
    a = omni_adapters.from_pretrained(ltx_path)
    assert isinstance(a, LTX2Adapter) and a.family == FAMILY and a.modality == "video+audio"
    assert not a.trainable_parameters()
    assert {"transformer", "vae", "audio_vae", "vocoder", "connectors", "text_encoder"} <= set(
        a.components
    )
    assert sum(p.numel() for p in a.model.parameters()) < 200_000
    assert a.fsdp_wrap_units()[0].__name__ == "LTX2VideoTransformerBlock"


def test_lora_binds_all_attention_projections(ltx_path):
    a = omni_adapters.from_pretrained(ltx_path)
    # 2 blocks x 6 attentions (video/audio self and text cross, audio->video, video->audio) x 4
    assert a.add_lora(rank=2) == 48
    with pytest.raises(ValueError, match="binds 0 modules"):
        a.add_lora(rank=2, target_modules=["nope"], adapter_name="bad")


def test_encode_shapes_and_negative_default(ltx):
    c = ltx.encode(["a red cube", "a blue ball"])
    # 2.3's per-modality projections: straight to each stream's width (video 16, audio 8)
    assert c["prompt_embeds"].shape == (2, 16, 16)
    assert c["audio_prompt_embeds"].shape == (2, 16, 8)
    assert c["prompt_attention_mask"].shape == (2, 16)
    empty = ltx.encode([""])
    torch.testing.assert_close(c["negative_prompt_embeds"][0], empty["prompt_embeds"][0])
    assert not torch.allclose(c["prompt_embeds"][0], c["prompt_embeds"][1])


def test_latents_are_video_then_audio_per_row(ltx):
    g = ltx.geometry(P)
    assert (g["cv"], g["f"], g["h"], g["w"]) == (4, 3, 8, 8)
    assert (g["ca"], g["la"], g["ma"]) == (2, 5, 2)
    x = ltx.init_latents(3, P, generators([5, 6, 7]))
    assert x.shape == (3, g["dv"] + g["da"]) and x.dtype == torch.float32
    y = ltx.init_latents(1, P, generators([6]))
    torch.testing.assert_close(x[1], y[0], rtol=0, atol=0)
    gen = generators([6])[0]
    video = torch.randn((4, 3, 8, 8), generator=gen)
    audio = torch.randn((2, 5, 2), generator=gen)
    v, a = ltx.split_latents(y, P)
    torch.testing.assert_close(v[0], video, rtol=0, atol=0)
    torch.testing.assert_close(a[0], audio, rtol=0, atol=0)
    torch.testing.assert_close(ltx.join_latents(v, a), y, rtol=0, atol=0)
    with pytest.raises(ValueError, match="num_frames"):
        ltx.geometry(Params(height=16, width=16, num_frames=4))


def test_sigmas_follow_the_pipeline_schedule(ltx):
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    s = ltx.sigmas(P)
    assert s.shape == (4,) and s[0] == 1.0 and s[-1] == 0.0
    assert (s[1:] < s[:-1]).all()
    mu = calculate_shift(3 * 8 * 8, 1024, 4096, 0.95, 2.05)
    base = torch.tensor([1.0, 2 / 3, 1 / 3], dtype=torch.float64)
    shifted = torch.exp(torch.tensor(mu)) / (torch.exp(torch.tensor(mu)) + 1 / base - 1)
    torch.testing.assert_close(s[:-1].double(), shifted, atol=1e-6, rtol=0)


def test_one_denoise_step_and_media(ltx):
    c = ltx.encode(["a cat playing drums", "rain"])
    x = ltx.init_latents(2, P, generators([1, 2]))
    s = ltx.sigmas(P)
    with torch.no_grad():
        v = ltx.velocity(x, s[0].expand(2), c, P)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    x1 = x + (s[1] - s[0]) * v
    media = ltx.decode_av(x1, P)
    assert media["frames"].shape == (2, 5, 16, 16, 3) and media["frames"].dtype == torch.uint8
    wave = media["waveform"]
    assert wave.dtype == torch.float32 and wave.shape[:2] == (2, 2) and wave.shape[2] > 0
    assert torch.isfinite(wave).all() and wave.abs().max() <= 1.0
    assert media["sample_rate"] == 16000
    assert torch.equal(ltx.decode(x1), media["frames"])


def test_audio_and_video_streams_interact(ltx):
    c = ltx.encode(["thunder"])
    x = ltx.init_latents(1, P, generators([3]))
    s = ltx.sigmas(P)[1].expand(1)
    dv = ltx.geometry(P)["dv"]
    x2 = x.clone()
    x2[:, dv:] += 1.0  # change only the audio latents
    with torch.no_grad():
        v1 = ltx.velocity(x, s, c, P)
        v2 = ltx.velocity(x2, s, c, P)
    assert (v1[:, :dv] - v2[:, :dv]).abs().max() > 1e-6  # the video velocity hears the audio


def test_cfg_is_packed_guidance(ltx):
    c = ltx.encode(["a bird"], negative_prompts=["noise"])
    x = ltx.init_latents(1, P, generators([4]))
    s = ltx.sigmas(P)[0].expand(1)
    cfg = Params(height=16, width=16, num_frames=5, num_steps=3, guidance_scale=3.0)
    pos = {k: v for k, v in c.items() if not k.startswith("negative_")}
    neg = {k: c["negative_" + k] for k in pos}
    with torch.no_grad():
        v = ltx.velocity(x, s, c, cfg)
        vp = ltx.velocity(x, s, pos, P)
        vn = ltx.velocity(x, s, neg, P)
    torch.testing.assert_close(v, vn + 3.0 * (vp - vn), atol=1e-5, rtol=1e-5)


def test_rollout_matches_replay(ltx):
    for params in (P, Params(height=16, width=16, num_frames=5, num_steps=3, guidance_scale=2.5)):
        rollout, replay = rollout_vs_replay(ltx, params, ["a", "b c", "d e f", "g"], [1, 2, 3, 4])
        assert (rollout - replay).abs().max().item() <= 1e-5
        assert pearson(rollout, replay) >= 0.9999


def test_export_import_round_trip(ltx_path, ltx):
    w = ltx.export_rollout_weights()
    assert w and all(".lora_" in k for k in w)
    fresh = omni_adapters.from_pretrained(ltx_path)
    fresh.add_lora(rank=4)
    ck = omni_adapters.weights_checksum
    assert ck(fresh.export_rollout_weights()) != ck(w)
    fresh.load_weights(ltx.export_rollout_weights("vllm_omni"))
    assert ck(fresh.export_rollout_weights()) == ck(w)
    c = ltx.encode(["sync"])
    x = ltx.init_latents(1, P, generators([9]))
    s = ltx.sigmas(P)[0].expand(1)
    with torch.no_grad():
        torch.testing.assert_close(
            ltx.velocity(x, s, c, P), fresh.velocity(x, s, c, P), rtol=0, atol=0
        )


def test_build_is_deterministic(tmp_path, ltx_path):
    from safetensors.torch import load_file

    again = omni_adapters.tiny.build(FAMILY, tmp_path / "again", seed=0)
    f = "transformer/diffusion_pytorch_model.safetensors"
    ck = omni_adapters.weights_checksum
    assert ck(load_file(ltx_path / f)) == ck(load_file(again / f))


def test_the_ltx20_layout_still_loads_and_denoises(tmp_path):
    path = build_tiny_version(tmp_path / "ltx20", seed=0, version="2.0")
    cfg = json.loads((path / "transformer" / "config.json").read_text())
    assert cfg["gated_attn"] is False and cfg["use_prompt_embeddings"] is True
    a = omni_adapters.from_pretrained(path)
    c = a.encode(["a robot"])
    assert c["prompt_embeds"].shape == (1, 16, 32)  # 2.0: caption projection in the DiT
    x = a.init_latents(1, P, generators([0]))
    with torch.no_grad():
        v = a.velocity(x, a.sigmas(P)[0].expand(1), c, P)
    assert v.shape == x.shape and torch.isfinite(v).all()
