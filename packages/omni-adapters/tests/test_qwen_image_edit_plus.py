"""Qwen-Image-Edit-Plus (several condition images per request) against diffusers'
QwenImageEditPlusPipeline: the same Qwen2.5-VL text condition ("Picture i:" prompts, 64
template tokens dropped) and the same packed, concatenated condition latents."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import omni_adapters
from omni_adapters.families.qwen_image import pack
from omni_adapters.families.qwen_image_edit import images_to_tensor
from omni_adapters.testing import Params, generators

FAMILY = "qwen_image_edit_plus"


@pytest.fixture(scope="module")
def plus_path(tiny_path):
    return tiny_path(FAMILY)


@pytest.fixture(scope="module")
def plus(plus_path):
    return omni_adapters.from_pretrained(plus_path)


@pytest.fixture(scope="module")
def pipe(plus_path):
    from diffusers import QwenImageEditPlusPipeline

    return QwenImageEditPlusPipeline.from_pretrained(plus_path)


def _img(seed: int, h: int = 16, w: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)


def test_picks_the_plus_adapter(plus):
    assert type(plus).__name__ == "QwenImageEditPlusAdapter" and plus.family == FAMILY
    assert plus.needs_images and plus.template_drop == 64
    assert plus.vl_condition_size == (16, 16) and plus.condition_size == (32, 32)


def test_text_condition_matches_the_pipeline(plus, pipe):
    a, b = _img(0), _img(1)
    ours = plus.encode_prompts(["put the cat on the sofa"], images=[[a, b]])
    with torch.no_grad():
        ref, ref_mask = pipe.encode_prompt(
            ["put the cat on the sofa"],
            image=[Image.fromarray(a.numpy()), Image.fromarray(b.numpy())],
        )
    # the pipeline drops an all-ones mask (None)
    n = ref.shape[1] if ref_mask is None else int(ref_mask[0].sum())
    assert int(ours["prompt_embeds_mask"][0].sum()) == n  # 2 x 4 image tokens + text
    torch.testing.assert_close(
        ours["prompt_embeds"][0, :n], ref[0, :n].float(), atol=1e-5, rtol=1e-5
    )


def test_condition_latents_match_the_pipeline(plus, pipe):
    a, b = _img(2, 32, 32), _img(3, 32, 32)
    ours = plus.encode_shared(images=[[a, b]])["image_latents"]
    assert ours.shape == (1, 2, 16, 8, 8)
    vae_images = [images_to_tensor(im[None], (32, 32)).mul(2).sub(1).unsqueeze(2) for im in (a, b)]
    with torch.no_grad():
        _, ref = pipe.prepare_latents(
            vae_images, 1, 16, 32, 32, torch.float32, torch.device("cpu"), None
        )
    torch.testing.assert_close(torch.cat([pack(ours[:, 0]), pack(ours[:, 1])], 1), ref)


def test_every_condition_image_joins_the_token_axis(plus):
    p = Params()
    x = plus.init_latents(1, p, generators([0]))
    s = torch.tensor([0.7])
    a, b = _img(4), _img(5)
    seen = {}

    def hook(module, args, kwargs):
        seen["tokens"] = kwargs["hidden_states"].shape[1]
        seen["shapes"] = kwargs["img_shapes"][0]

    h = plus.model.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        v_ab = plus.velocity(x, s, plus.encode(["mix them"], images=[[a, b]]), p)
    h.remove()
    assert seen["tokens"] == 16 * 3 and seen["shapes"] == [(1, 4, 4)] * 3
    with torch.no_grad():
        v_ba = plus.velocity(x, s, plus.encode(["mix them"], images=[[b, a]]), p)
    assert not torch.allclose(v_ab, v_ba)  # the order of the pictures matters


def test_image_count_errors_name_the_field(plus, tiny_path):
    a = _img(6)
    with pytest.raises(ValueError, match="same number of condition images"):
        plus.encode(["x", "y"], images=[[a, a], [a]])
    with pytest.raises(ValueError, match="images"):
        plus.encode(["x"])
    # one image per row in the plain (B, H, W, 3) form still works (K = 1)
    c = plus.encode(["x"], images=a[None])
    assert c["image_latents"].shape[1] == 1
    edit = omni_adapters.from_pretrained(tiny_path("qwen_image_edit"))
    with pytest.raises(ValueError, match=r"qwen_image_edit takes 1 to 1 condition image"):
        edit.encode(["x"], images=[[a, a]])
