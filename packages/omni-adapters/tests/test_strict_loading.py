"""Every family reads its checkpoint strictly: one renamed tensor of the trainable component
fails with an error naming both names, a removed one is listed as missing, an extra one as
unexpected (diffusers and transformers would initialise a missing tensor at random and only
warn). The tiny folders are in each library's own save layout; BAGEL's release layout has its
own fixture (test_release_bagel.py)."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

import omni_adapters
from omni_adapters.checkpoints import CheckpointKeyError

#: family -> (weights file of the trainable component, a tensor in it)
CASES = {
    "sd3": (
        "transformer/diffusion_pytorch_model.safetensors",
        "transformer_blocks.0.attn.to_q.weight",
    ),
    "qwen_image": (
        "transformer/diffusion_pytorch_model.safetensors",
        "transformer_blocks.1.img_mlp.net.2.weight",
    ),
    "qwen_image_edit_plus": ("transformer/diffusion_pytorch_model.safetensors", "img_in.weight"),
    "wan22_a14b": (
        "transformer_2/diffusion_pytorch_model.safetensors",
        "blocks.0.attn2.to_k.weight",
    ),
    "ltx2": (
        "transformer/diffusion_pytorch_model.safetensors",
        "transformer_blocks.0.audio_to_video_attn.to_v.weight",
    ),
    "qwen3_omni_thinker": ("model.safetensors", "thinker.model.layers.0.self_attn.q_proj.weight"),
}


def _copy_with(tmp_path, src, rel, edit):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    sd = load_file(str(dst / rel))
    edit(sd)
    save_file(sd, str(dst / rel), metadata={"format": "pt"})
    return dst


def _load(path, family):
    return omni_adapters.from_pretrained(path, **({"stage": "thinker"} if "omni" in family else {}))


@pytest.mark.parametrize("family", list(CASES))
def test_renamed_missing_and_extra_tensors_are_named(family, tiny_path, tmp_path):
    rel, key = CASES[family]
    src = tiny_path(family)
    assert key in load_file(str(src / rel)), key
    new = key.replace(".weight", ".weight_renamed")

    def rename(sd):
        sd[new] = sd.pop(key)

    with pytest.raises(CheckpointKeyError) as err:
        _load(_copy_with(tmp_path / "a", src, rel, rename), family)
    assert key.removeprefix("thinker.") in str(err.value) and new.removeprefix("thinker.") in str(
        err.value
    )

    with pytest.raises(CheckpointKeyError) as err:
        _load(_copy_with(tmp_path / "b", src, rel, lambda sd: sd.pop(key)), family)
    assert err.value.missing and key.removeprefix("thinker.") in err.value.missing[0]

    def extra(sd):
        sd[key.rsplit(".", 2)[0] + ".extra.weight"] = sd[key][:1].clone()

    with pytest.raises(CheckpointKeyError, match="unexpected"):
        _load(_copy_with(tmp_path / "c", src, rel, extra), family)


def test_the_thinker_skips_only_talker_and_code2wav(tiny_path, tmp_path):
    """The full Qwen3-Omni checkpoint's talker and code2wav tensors are the only ones the
    thinker stage leaves unused; an unknown tensor elsewhere is still an error."""
    src = tiny_path("qwen3_omni_thinker")
    sd = load_file(str(src / "model.safetensors"))
    assert any(k.startswith("talker.") for k in sd) and any(k.startswith("code2wav.") for k in sd)
    omni_adapters.from_pretrained(src, stage="thinker")  # loads: talker/code2wav skipped by name

    def stray(sd):
        sd["thinker.stray.weight"] = next(iter(sd.values()))[:1].clone()

    with pytest.raises(CheckpointKeyError, match=r"stray\.weight"):
        _load(_copy_with(tmp_path, src, "model.safetensors", stray), "qwen3_omni_thinker")


@pytest.mark.parametrize(
    ("family", "component"), [("sd3", "transformer"), ("qwen3_omni_thinker", None)]
)
def test_released_bf16_shards_load(family, component, tiny_path, tmp_path):
    """Releases ship bfloat16 weights in shards with an index (``diffusion_pytorch_model-
    0000i-of-0000N.safetensors`` / ``model-...``); they load strictly in that form too, and a
    renamed tensor inside a shard is still named."""
    import json

    import torch

    src = tiny_path(family)
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    folder = dst / component if component else dst
    if component:
        from diffusers import SD3Transformer2DModel as klass
    else:
        from transformers import Qwen3OmniMoeForConditionalGeneration as klass
    key = "torch_dtype" if component else "dtype"
    model = klass.from_pretrained(folder, **{key: torch.bfloat16})
    for f in folder.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(folder, max_shard_size="50KB")
    index = json.loads(next(folder.glob("*.safetensors.index.json")).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all("-of-" in s for s in shards)
    a = _load(dst, family)
    p = next(a.model.parameters())
    assert p.dtype == torch.float32  # loaded in the requested dtype (default float32)

    # a tensor the loaded model uses (the thinker stage leaves talker/code2wav unused)
    key = next(
        k
        for k in sorted(index["weight_map"])
        if k.endswith(".weight") and "talker" not in k and "code2wav" not in k
    )
    shard = folder / index["weight_map"][key]
    sd = load_file(str(shard))
    sd[key + "_renamed"] = sd.pop(key)
    save_file(sd, str(shard), metadata={"format": "pt"})
    index["weight_map"][key + "_renamed"] = index["weight_map"].pop(key)
    next(folder.glob("*.safetensors.index.json")).write_text(json.dumps(index))
    with pytest.raises(CheckpointKeyError) as err:
        _load(dst, family)
    assert key.removeprefix("thinker.") in str(err.value)
