"""What every diffusion family must pass (issue 5, "how it will be checked"): tiny build,
load through from_pretrained, LoRA binds > 0 modules, one denoise step, CFG packed in one
forward, rollout/replay log-prob agreement, export/import round trip with equal checksum,
FSDP wrap units present."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import omni_adapters
from omni_adapters.testing import Params, generators, pearson, perturb_lora, rollout_vs_replay


def _images(b: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 24, 40, 3), generator=g, dtype=torch.uint8)


CASES = {
    "sd3": (Params(guidance_scale=3.0), lambda b: {}),
    "qwen_image": (Params(true_cfg_scale=3.0), lambda b: {}),
    "qwen_image_edit": (Params(true_cfg_scale=3.0), lambda b: {"images": _images(b)}),
    # two condition images per request (Qwen-Image-Edit-2509/2511)
    "qwen_image_edit_plus": (
        Params(true_cfg_scale=3.0),
        lambda b: {"images": [[im, im.flip(0)] for im in _images(b)]},
    ),
    "wan22": (Params(num_frames=5, guidance_scale=3.0), lambda b: {}),
    "wan22_a14b": (Params(num_frames=5, guidance_scale=3.0), lambda b: {}),
}
CLASSES = {
    "sd3": "SD3Adapter",
    "qwen_image": "QwenImageAdapter",
    "qwen_image_edit": "QwenImageEditAdapter",
    "qwen_image_edit_plus": "QwenImageEditPlusAdapter",
    "wan22": "Wan22Adapter",
    "wan22_a14b": "Wan22Adapter",
}

pytestmark = pytest.mark.parametrize("family", list(CASES))


def test_load_encode_denoise_decode(family, tiny_path):
    adapter = omni_adapters.from_pretrained(tiny_path(family))
    assert type(adapter).__name__ == CLASSES[family]
    assert adapter.family == family.removesuffix("_a14b")
    params, extra = CASES[family]
    cond = adapter.encode(["a red cube", "a dog"], **extra(2))
    assert any(k.startswith("negative_") for k in cond)
    assert all(v.shape[0] == 2 for v in cond.values())
    x = adapter.init_latents(2, params, generators([0, 1]))
    assert x.dtype == torch.float32
    sig = adapter.sigmas(params)
    assert sig.shape == (params.num_steps + 1,) and sig[-1] == 0 and sig[0] == pytest.approx(1.0)
    assert bool((sig[1:] < sig[:-1]).all())
    with torch.no_grad():
        v = adapter.velocity(x, sig[0].expand(2), cond, params)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    media = adapter.decode(x + (sig[1] - sig[0]) * v)
    assert media.dtype == torch.uint8 and media.shape[-1] == 3
    assert media.shape[0] == 2 and media.shape[-3:-1] == (params.height, params.width)
    if adapter.modality == "video":
        assert media.shape[1] == params.num_frames


def test_lora_binds_and_trains(family, tiny_path):
    adapter = omni_adapters.from_pretrained(tiny_path(family))
    assert adapter.add_lora(4) > 0
    assert adapter.trainable_parameters()
    assert all("lora_" in n for n in adapter.named_trainable_parameters())
    with pytest.raises(ValueError, match="binds 0 modules"):
        adapter.add_lora(4, target_modules=["not_a_module"], adapter_name="x")


def test_rollout_and_replay_agree(family, tiny_path):
    adapter = omni_adapters.from_pretrained(tiny_path(family))
    adapter.add_lora(4)
    perturb_lora(adapter, seed=5)
    params, extra = CASES[family]
    params = dataclasses.replace(params, num_steps=3)
    prompts = ["a red cube", "a dog", "two cats", "a tree"]
    rollout, replay = rollout_vs_replay(adapter, params, prompts, [1, 2, 3, 4], extra(4))
    assert torch.isfinite(rollout).all()
    assert pearson(rollout, replay) >= 0.9999
    assert float((rollout - replay).abs().max()) <= 1e-5


def test_export_import_round_trip(family, tiny_path):
    trainer = omni_adapters.from_pretrained(tiny_path(family))
    trainer.add_lora(4)
    perturb_lora(trainer, seed=9)
    w = trainer.export_rollout_weights()
    rollout = omni_adapters.from_pretrained(tiny_path(family))
    rollout.add_lora(4)
    rollout.load_weights(w)
    assert omni_adapters.weights_checksum(rollout.export_rollout_weights()) == (
        omni_adapters.weights_checksum(w)
    )
    params, extra = CASES[family]
    cond = trainer.encode(["a cat"], **extra(1))
    x = trainer.init_latents(1, params, generators([3]))
    s = torch.tensor([0.6])
    with torch.no_grad():
        torch.testing.assert_close(
            trainer.velocity(x, s, cond, params), rollout.velocity(x, s, cond, params)
        )


def test_fsdp_units_and_mixed_precision(family, tiny_path):
    adapter = omni_adapters.from_pretrained(tiny_path(family))
    units = adapter.fsdp_wrap_units()
    experts = list(adapter.model.values()) if family == "wan22_a14b" else [adapter.model]
    # two blocks per transformer in every tiny model
    assert units and len(adapter.fsdp_wrap_modules()) == 2 * len(experts)
    assert [u.__name__ for u in units] == list(experts[0]._no_split_modules)
    assert adapter.mixed_precision_policy()["reduce_dtype"] == torch.float32
