"""BAGEL-7B-MoT's released folder (written by tests/release_fixtures.py from the official
code's names, not by omni_adapters) loads through ``omni_adapters.from_pretrained``; a renamed,
missing or extra tensor fails with its name."""

from __future__ import annotations

import pytest
import torch
from release_fixtures import write_bagel_release

import omni_adapters
from omni_adapters.checkpoints import CheckpointKeyError
from omni_adapters.families.bagel import BagelAdapter
from omni_adapters.testing import Params, generators

P = Params(height=32, width=32, num_steps=2, guidance_scale=2.0)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("bagel_release") / "BAGEL-7B-MoT"
    tensors = write_bagel_release(root)
    return root, tensors


def test_release_loads_with_every_tensor_in_place(release):
    root, tensors = release
    assert omni_adapters.read_architecture(root) == "Bagel"
    a = omni_adapters.from_pretrained(root)
    assert isinstance(a, BagelAdapter)
    own = a.model.state_dict()
    for k, v in tensors["ema"].items():
        torch.testing.assert_close(own[k], v.float(), rtol=0, atol=0, msg=k)
    # the autoencoder is the released FLUX one, renamed into diffusers' AutoencoderKL
    vae = a.components["vae"].state_dict()
    torch.testing.assert_close(
        vae["encoder.down_blocks.0.resnets.0.conv1.weight"],
        tensors["ae"]["encoder.down.0.block.0.conv1.weight"],
    )
    torch.testing.assert_close(
        vae["decoder.mid_block.attentions.0.to_q.weight"],
        tensors["ae"]["decoder.mid.attn_1.q.weight"][:, :, 0, 0],
    )
    # the geometry the official code hard-codes, read back from the tensor shapes
    cfg = a.model.config
    assert (cfg.latent_patch_size, cfg.max_latent_size, cfg.vit_max_num_patch_per_side) == (2, 8, 4)
    assert cfg.vit_num_hidden_layers == 2  # vit_config.json says 3; the official loader drops one
    assert a.components["vae"].config.scaling_factor == pytest.approx(0.3611)


def test_release_generates_and_understands(release):
    a = omni_adapters.from_pretrained(release[0])
    c = a.encode(["a red cube"])
    # <|im_start|> prompt <|im_end|> (the official prepare_prompts); "" is the empty context
    ids = c["input_ids"][0][c["attention_mask"][0].bool()].tolist()
    assert ids[0] == a.model.config.bos_token_id and ids[-1] == a.model.config.eos_token_id
    assert c["negative_attention_mask"].sum() == 0
    x = a.init_latents(1, P, generators([0]))
    assert x.shape == (1, 4, 16, 16)
    with torch.no_grad():
        v = a.velocity(x, a.sigmas(P)[0].expand(1), c, P)
        img = a.decode(x)
        logits = a.understand(["what is it"], torch.zeros(1, 3, 16, 16))
    assert torch.isfinite(v).all() and img.shape == (1, 32, 32, 3)
    assert logits.shape[-1] == 320


@pytest.mark.parametrize(
    ("file", "old", "new"),
    [
        ("ema", "connector.fc1.weight", "connector.0.weight"),
        (
            "ema",
            "language_model.model.layers.0.mlp_moe_gen.up_proj.weight",
            "language_model.layers.0.mlp_moe_gen.up_proj.weight",
        ),
        ("ae", "decoder.up.1.block.0.conv1.weight", "decoder.up_blocks.0.resnets.0.conv1.weight"),
    ],
)
def test_renamed_key_fails_naming_it(tmp_path, release, file, old, new):
    tensors = {k: dict(v) for k, v in release[1].items()}
    tensors[file][new] = tensors[file].pop(old)
    write_bagel_release(tmp_path / "b", **tensors)
    with pytest.raises((CheckpointKeyError, ValueError)) as err:
        omni_adapters.from_pretrained(tmp_path / "b")
    assert new in str(err.value)
    if file == "ema":
        assert old in str(err.value) and "missing" in str(err.value)


def test_missing_and_extra_tensors_are_listed(tmp_path, release):
    ema = dict(release[1]["ema"])
    del ema["vit_pos_embed.pos_embed"]
    ema["extra.weight"] = torch.zeros(2)
    write_bagel_release(tmp_path / "b", ema=ema, ae=release[1]["ae"])
    with pytest.raises(ValueError, match=r"vit_pos_embed\.pos_embed"):
        omni_adapters.from_pretrained(tmp_path / "b")
    ema = dict(release[1]["ema"])
    ema["language_model.model.norm.weight"] = torch.zeros(7)
    ema["extra.weight"] = torch.zeros(2)
    write_bagel_release(tmp_path / "c", ema=ema, ae=release[1]["ae"])
    with pytest.raises(CheckpointKeyError) as err:
        omni_adapters.from_pretrained(tmp_path / "c")
    assert err.value.unexpected == ["extra.weight"]
    assert err.value.mismatched and "language_model.model.norm.weight" in err.value.mismatched[0]
