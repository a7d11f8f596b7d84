"""`module_dtype` (the cheap dtype lookup every transformer forward uses) answers what
diffusers' ``ModelMixin.dtype`` answers, on every diffusion family's tiny model: loaded in
float32 and in bfloat16, with a LoRA adapter injected (peft's layers come first in the walk
diffusers does) and with the fp32-kept modules of the families that declare them."""

from __future__ import annotations

import pytest
import torch
from diffusers import ModelMixin

import omni_adapters
from omni_adapters.base import module_dtype

FAMILIES = ["sd3", "qwen_image", "qwen_image_edit_plus", "wan22", "wan22_a14b", "ltx2"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_dtype_equals_diffusers_dtype(family, dtype, tiny_path):
    adapter = omni_adapters.from_pretrained(tiny_path(family), dtype=dtype)
    adapter.add_lora(4)
    models = [m for m in adapter.components.values() if isinstance(m, ModelMixin)]
    assert models, family
    for m in models:
        assert module_dtype(m) == m.dtype == dtype, (family, type(m).__name__)


def test_module_dtype_skips_fp32_kept_modules_and_needs_parameters():
    class Kept(torch.nn.Module):
        _keep_in_fp32_modules = ("norm",)

        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(4)  # first in the walk, kept in float32
            self.proj = torch.nn.Linear(4, 4).to(torch.bfloat16)

    assert module_dtype(Kept()) == torch.bfloat16
    with pytest.raises(ValueError, match="module_dtype: Identity has no parameters"):
        module_dtype(torch.nn.Identity())
