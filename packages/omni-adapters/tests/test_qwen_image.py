"""Qwen-Image and Qwen-Image-Edit specifics: packing, true CFG with norm rescale, dynamic
shift, template prefix, edit conditioning on the token axis."""

from __future__ import annotations

import json

import pytest
import torch

import omni_adapters
from omni_adapters.families.qwen_image import calculate_shift, pack, unpack
from omni_adapters.testing import Params, euler_sample, generators


@pytest.fixture()
def qwen(tiny_path):
    return omni_adapters.from_pretrained(tiny_path("qwen_image"))


@pytest.fixture()
def edit(tiny_path):
    return omni_adapters.from_pretrained(tiny_path("qwen_image_edit"))


def _imgs(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 32, 32, 3), generator=g, dtype=torch.uint8)


def test_pack_unpack_inverse_and_layout():
    x = torch.randn(2, 16, 8, 6)
    t = pack(x)
    assert t.shape == (2, 4 * 3, 64)
    torch.testing.assert_close(unpack(t, 8, 6), x, rtol=0, atol=0)
    # token 0 holds the top-left 2x2 patch, channel-major
    torch.testing.assert_close(t[0, 0].view(16, 2, 2), x[0, :, :2, :2])


def test_true_cfg_rescales_to_the_conditional_norm(qwen):
    p1, p4 = Params(), Params(true_cfg_scale=4.0)
    c = qwen.encode(["a red cube"], negative_prompts=["blurry"])
    x = qwen.init_latents(1, p1, generators([0]))
    s = torch.tensor([0.8])
    neg = {k: c["negative_" + k] for k in ("prompt_embeds", "prompt_embeds_mask")}
    with torch.no_grad():
        vp, vn, v = (
            qwen.velocity(x, s, c, p1),
            qwen.velocity(x, s, neg, p1),
            qwen.velocity(x, s, c, p4),
        )
    comb = pack(vn) + 4.0 * (pack(vp) - pack(vn))
    want = comb * pack(vp).norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(v, unpack(want, 8, 8), atol=1e-5, rtol=1e-5)
    # guidance_scale is not Qwen-Image's CFG switch
    with torch.no_grad():
        torch.testing.assert_close(qwen.velocity(x, s, c, Params(guidance_scale=4.0)), vp)


def test_sigmas_use_the_dynamic_exponential_shift(qwen, tiny_path):
    cfg = json.loads((tiny_path("qwen_image") / "scheduler" / "scheduler_config.json").read_text())
    n = 6
    mu = calculate_shift(
        16, cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"], cfg["max_shift"]
    )
    t = torch.linspace(1.0, 1.0 / n, n, dtype=torch.float64)
    shifted = torch.exp(torch.tensor(mu)) / (torch.exp(torch.tensor(mu)) + (1 / t - 1))
    # shift_terminal stretches the tail so the last non-zero sigma is the terminal value
    one_minus = 1 - shifted
    stretched = 1 - one_minus / (one_minus[-1] / (1 - cfg["shift_terminal"]))
    s = qwen.sigmas(Params(num_steps=n))
    torch.testing.assert_close(s[:-1], stretched.float())
    assert s[-2] == pytest.approx(cfg["shift_terminal"])
    assert (
        qwen.sigmas(Params(num_steps=n, height=64, width=64))[1] > s[1]
    )  # more tokens, more shift


def test_text_condition_drops_the_template_prefix(qwen):
    tok = qwen.components["tokenizer"]
    assert qwen.template_drop == len(tok(qwen.prompt_template.split("{}")[0]).input_ids)
    c = qwen.encode(["ab", "a much longer prompt"])
    mask = c["prompt_embeds_mask"]
    assert mask.shape == (2, 32)
    assert mask[0].sum() < mask[1].sum()
    assert c["prompt_embeds"][0, int(mask[0].sum()) :].abs().sum() == 0


def test_matches_the_diffusers_pipeline(tiny_path, qwen):
    """Template drop (34 tokens, as the pipeline hard-codes), dynamic shift, true CFG with
    norm rescale and packing all agree with diffusers' QwenImagePipeline."""
    from diffusers import QwenImagePipeline

    assert qwen.template_drop == 34
    p = Params(num_steps=3, true_cfg_scale=3.0)
    x0 = qwen.init_latents(1, p, generators([0]))
    ours = euler_sample(qwen, p, ["a red cube"], x0)
    pipe = QwenImagePipeline.from_pretrained(tiny_path("qwen_image"))
    ref = pipe(
        "a red cube",
        negative_prompt="",
        height=32,
        width=32,
        num_inference_steps=3,
        true_cfg_scale=3.0,
        latents=pack(x0.clone()),
        output_type="latent",
    ).images
    torch.testing.assert_close(pack(ours), ref, atol=1e-5, rtol=1e-5)


def test_edit_template_prefix_is_64_tokens_as_in_the_pipeline(edit):
    assert edit.template_drop == 64


def test_edit_needs_images_and_encodes_them(edit):
    with pytest.raises(ValueError, match="images"):
        edit.encode(["make it red"])
    c = edit.encode(["make it red", "make it blue"], images=_imgs(2))
    assert c["image_latents"].shape == (2, 16, 8, 8)
    assert "negative_image_latents" not in c  # shared by both branches
    # 16 vision tokens of a 32 px image sit inside the valid text condition
    assert int(c["prompt_embeds_mask"][0].sum()) > 16
    with pytest.raises(ValueError, match="images"):
        edit.encode(["a"], images=torch.zeros(1, 8, 8))


def test_edit_condition_latents_join_the_token_axis_and_are_cropped(edit):
    p = Params()
    x = edit.init_latents(2, p, generators([0, 1]))
    s = torch.tensor([0.7, 0.7])
    a = edit.encode(["make it red"] * 2, images=_imgs(2, seed=0))
    b = edit.encode(["make it red"] * 2, images=_imgs(2, seed=1))
    seen = {}

    def hook(module, args, kwargs):
        seen["tokens"] = kwargs["hidden_states"].shape[1]
        seen["shapes"] = kwargs["img_shapes"][0]

    h = edit.model.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        va = edit.velocity(x, s, a, p)
    h.remove()
    assert seen["tokens"] == 16 + 16 and seen["shapes"] == [(1, 4, 4), (1, 4, 4)]
    assert va.shape == x.shape
    with torch.no_grad():
        vb = edit.velocity(x, s, {**a, "image_latents": b["image_latents"]}, p)
    assert not torch.allclose(va, vb)


def test_edit_images_of_different_sizes_resize_row_by_row():
    from omni_adapters.families.qwen_image_edit import images_to_tensor

    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8)
    b = torch.randint(0, 256, (24, 40, 3), generator=g, dtype=torch.uint8)
    both = images_to_tensor([a, b.numpy()], (16, 16))
    assert both.shape == (2, 3, 16, 16)
    assert torch.equal(both[0], images_to_tensor(a[None], (16, 16))[0])
    assert torch.equal(both[1], images_to_tensor(b[None], (16, 16))[0])
