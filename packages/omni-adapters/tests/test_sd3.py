"""SD3 family: tiny build, load, Denoiser protocol, LoRA, replay consistency, weight sync."""

from __future__ import annotations

import json

import pytest
import torch

import omni_adapters
from omni_adapters.families.sd3 import SD3Adapter
from omni_adapters.testing import Params, euler_sample, generators, perturb_lora


@pytest.fixture()
def sd3(tiny_path):
    return omni_adapters.from_pretrained(tiny_path("sd3"))


def test_build_writes_a_diffusers_pipeline_folder(tiny_path):
    root = tiny_path("sd3")
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["transformer"] == ["diffusers", "SD3Transformer2DModel"]
    assert index["text_encoder_3"] == ["transformers", "T5EncoderModel"]
    assert (root / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert not list(root.rglob("*.bin")) and not list(root.rglob("*.pkl"))


def assert_samples_as_the_pipeline(model, pipe, **pipe_kwargs) -> None:
    """3 Euler steps with guidance 3 from the same initial latents: the adapter's latents equal
    those of diffusers' `pipe`."""
    p = Params(num_steps=3, guidance_scale=3.0)
    x0 = model.init_latents(1, p, generators([0]))
    ours = euler_sample(model, p, ["a red cube"], x0)
    ref = pipe(
        "a red cube",
        negative_prompt="",
        height=32,
        width=32,
        num_inference_steps=3,
        guidance_scale=3.0,
        latents=x0.clone(),
        output_type="latent",
        **pipe_kwargs,
    ).images
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_matches_the_diffusers_pipeline(tiny_path, sd3):
    """Same latents in, same latents out: encode, sigmas, timestep scale and CFG all agree
    with diffusers' own StableDiffusion3Pipeline on the tiny folder."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_path("sd3"))
    assert_samples_as_the_pipeline(sd3, pipe, max_sequence_length=16)


def test_without_t5_matches_the_diffusers_pipeline(tiny_path, tmp_path):
    """A folder saved without T5 (diffusers writes `text_encoder_3: [null, null]`, as
    SD3-medium's `text_encoder_3=None` loading does): the adapter loads it and samples what
    diffusers' own pipeline samples, its T5 part of the embedding zeros as there."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(
        tiny_path("sd3"), text_encoder_3=None, tokenizer_3=None
    )
    folder = tmp_path / "sd3-no-t5"
    pipe.save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["text_encoder_3"] == [None, None] and not (folder / "text_encoder_3").exists()
    model = omni_adapters.from_pretrained(folder)
    c = model.encode(["a red cube"])
    # CLIP's 16 tokens, then the pipeline's default max_sequence_length (256) of T5 zeros
    assert c["prompt_embeds"].shape == (1, 16 + 256, 48)
    assert torch.count_nonzero(c["prompt_embeds"][:, 16:]) == 0
    assert_samples_as_the_pipeline(model, pipe)  # the pipeline's default T5 length


def test_build_is_deterministic_per_seed(tmp_path, tiny_path):
    from safetensors.torch import load_file

    omni_adapters.tiny.build("sd3", tmp_path / "again", seed=0)
    omni_adapters.tiny.build("sd3", tmp_path / "other", seed=1)
    f = "transformer/diffusion_pytorch_model.safetensors"
    a = load_file(tiny_path("sd3") / f)
    b = load_file(tmp_path / "again" / f)
    c = load_file(tmp_path / "other" / f)
    ck = omni_adapters.weights_checksum
    assert ck(a) == ck(b)
    assert ck(a) != ck(c)
    with pytest.raises(FileExistsError):
        omni_adapters.tiny.build("sd3", tmp_path / "again")


def test_from_pretrained_picks_sd3_adapter(sd3):
    assert isinstance(sd3, SD3Adapter)
    assert sd3.family == "sd3"
    assert sum(p.numel() for p in sd3.model.parameters()) < 200_000
    assert not sd3.trainable_parameters()  # everything frozen until LoRA
    assert sd3.tokenizer_config()["tokenizer"]["model_max_length"] == 16


def test_encode_shapes_and_negative_default(sd3):
    c = sd3.encode(["a red cube", "a blue ball"])
    assert c["prompt_embeds"].shape == (2, 32, 48)
    assert c["pooled_prompt_embeds"].shape == (2, 40)
    assert c["negative_prompt_embeds"].shape == (2, 32, 48)
    empty = sd3.encode([""])
    torch.testing.assert_close(c["negative_prompt_embeds"][1], empty["prompt_embeds"][0])
    assert not torch.allclose(c["prompt_embeds"][0], c["prompt_embeds"][1])
    with pytest.raises(ValueError, match="negative_prompts"):
        sd3.encode(["a", "b"], negative_prompts=["x"])


def test_init_latents_rows_are_independent(sd3):
    p = Params()
    x = sd3.init_latents(3, p, generators([5, 6, 7]))
    assert x.shape == (3, 16, 8, 8) and x.dtype == torch.float32
    y = sd3.init_latents(1, p, generators([6]))
    torch.testing.assert_close(x[1], y[0], rtol=0, atol=0)
    torch.testing.assert_close(y[0], torch.randn((16, 8, 8), generator=generators([6])[0]))
    with pytest.raises(ValueError, match="height"):
        sd3.latent_shape(Params(height=30))


def test_sigmas_follow_the_shift_3_schedule(sd3):
    s = sd3.sigmas(Params(num_steps=8))
    assert s.shape == (9,) and s.dtype == torch.float32
    assert s[0] == pytest.approx(1.0) and s[-1] == 0.0
    assert bool((s[1:] < s[:-1]).all())
    # pipeline grid: t in linspace(1, sigma_min, N) with sigma_min the shifted training
    # sigma at t = 1/1000, then shifted by s = 3 t / (1 + 2 t)
    shift = lambda t: 3 * t / (1 + 2 * t)  # noqa: E731
    t = shift(torch.linspace(1.0, shift(1e-3), 8, dtype=torch.float64))
    torch.testing.assert_close(s[:-1], t.float())


def test_velocity_cfg_packs_both_branches(sd3):
    p1, p45 = Params(), Params(guidance_scale=4.5)
    c = sd3.encode(["a red cube", "a dog"], negative_prompts=["blurry", ""])
    x = sd3.init_latents(2, p1, generators([0, 1]))
    sig = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v_pos = sd3.velocity(x, sig, c, p1)
        neg = {k: c["negative_" + k] for k in ("prompt_embeds", "pooled_prompt_embeds")}
        v_neg = sd3.velocity(x, sig, neg, p1)
        v_cfg = sd3.velocity(x, sig, c, p45)
    assert v_cfg.shape == x.shape and v_cfg.dtype == torch.float32
    torch.testing.assert_close(v_cfg, v_neg + 4.5 * (v_pos - v_neg), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(v_cfg, v_pos)
    with pytest.raises(ValueError, match="sigma"):
        sd3.velocity(x, torch.tensor([0.5, 0.5, 0.5]), c, p1)
    with pytest.raises(ValueError, match="negative_"):
        sd3.velocity(x, sig, neg, p45)


def test_decode_gives_uint8_channels_last(sd3):
    x = sd3.init_latents(2, Params(), generators([0, 1]))
    img = sd3.decode(x)
    assert img.shape == (2, 32, 32, 3) and img.dtype == torch.uint8


def test_lora_binds_attention_projections(sd3):
    n = sd3.add_lora(4)
    # 2 blocks x (to_q,k,v,out.0) + block0 attn2 x 4 + add_q/k/v (2 blocks) + to_add_out (block 0)
    assert n == 2 * 4 + 4 + 2 * 3 + 1
    names = set(sd3.named_trainable_parameters())
    assert "transformer_blocks.0.attn.add_q_proj.lora_A.default.weight" in names
    assert "transformer_blocks.0.attn2.to_q.lora_B.default.weight" in names
    assert all("lora_" in k for k in names)
    with pytest.raises(ValueError, match="binds 0 modules"):
        sd3.add_lora(4, target_modules=["to_nothing"], adapter_name="bad")


def test_lora_starts_as_identity_and_gets_gradients(sd3):
    p = Params()
    c = sd3.encode(["a cat"])
    x = sd3.init_latents(1, p, generators([0]))
    sig = torch.tensor([0.7])
    with torch.no_grad():
        base = sd3.velocity(x, sig, c, p)
    sd3.add_lora(4)
    with torch.no_grad():
        torch.testing.assert_close(sd3.velocity(x, sig, c, p), base)
    perturb_lora(sd3)
    v = sd3.replay_velocity(x, sig, c, p)
    v.square().mean().backward()
    grads = [q.grad for q in sd3.trainable_parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    with torch.no_grad(), sd3.disabled_adapters():
        torch.testing.assert_close(sd3.velocity(x, sig, c, p), base)
    assert sd3.trainable_parameters()  # flags restored after the reference pass


def test_old_adapter_copy_and_ema(sd3):
    sd3.add_lora(4)
    perturb_lora(sd3, seed=1)
    assert sd3.add_adapter_copy("default", "old") > 0
    cur, old = sd3.adapter_state("default"), sd3.adapter_state("old")
    assert all(torch.equal(cur[k], old[k]) for k in cur)
    assert not any(q.requires_grad for q in old.values())
    perturb_lora(sd3, seed=2)
    before = {k: v.clone() for k, v in old.items()}
    sd3.ema_adapter("default", "old", decay=0.9)
    for k in cur:
        torch.testing.assert_close(old[k], 0.9 * before[k] + 0.1 * cur[k])
    p = Params()
    c = sd3.encode(["a cat"])
    x = sd3.init_latents(1, p, generators([0]))
    with torch.no_grad():
        v_cur = sd3.velocity(x, torch.tensor([0.5]), c, p)
        with sd3.use_adapter("old"):
            v_old = sd3.velocity(x, torch.tensor([0.5]), c, p)
    assert not torch.allclose(v_cur, v_old)
    assert sd3.active_adapter() == "default"
    assert set(sd3.named_trainable_parameters()) == {
        n for n in sd3.named_trainable_parameters() if ".default." in n
    }


def test_load_options_dtype_strip_checkpointing(tiny_path):
    a = omni_adapters.from_pretrained(
        tiny_path("sd3"), dtype="bfloat16", strip=["vae"], gradient_checkpointing=True
    )
    assert a.model.dtype == torch.bfloat16 and a.dtype == torch.bfloat16
    assert "vae" not in a.components
    assert a.model.gradient_checkpointing
    a.add_lora(4)
    p = Params()
    c = a.encode(["a cat"])
    x = a.init_latents(1, p, generators([0]))
    v = a.replay_velocity(x, torch.tensor([0.5]), c, p)
    assert v.dtype == torch.float32  # SDE math downstream stays float32
    v.float().square().mean().backward()
    assert any(q.grad is not None for q in a.trainable_parameters())
    with pytest.raises(ValueError, match="trainable component"):
        omni_adapters.from_pretrained(tiny_path("sd3"), strip=["transformer"])


def test_word_tokenizers_make_each_word_one_token():
    """The word-level CLIP (BPE merges learned on the words) and T5 (Unigram pieces)
    tokenizers of the toy SD3: every word is one token, other text still tokenizes."""
    from omni_adapters.tokenizers_tiny import clip_word_tokenizer, t5_word_tokenizer

    words = ["a", "and", "red", "green", "circle", "circles", "triangle", "left", "of", "cross"]
    clip, t5 = clip_word_tokenizer(words, 12), t5_word_tokenizer(words, 12)
    for w in words:
        assert clip.tokenize(w) == [w + "</w>"]
        assert t5.tokenize(w) == ["▁" + w]
    text = "a red circle left of a green triangle"
    ids = clip(text, padding="max_length", max_length=12).input_ids
    assert len(ids) == 12 and ids[0] == clip.bos_token_id and ids[9] == clip.eos_token_id
    assert len(clip.tokenize("blue")) == 4  # not a word of the list: one token per character
    assert len(t5.tokenize(text)) == 8
