"""DiNa-LRM in its released layout (written by release_fixtures from the official names):
converted once, loaded strictly on a tiny SD3 backbone, scoring SD3 latents; the LoRA load is
checked against peft's own loader of the same adapter folder."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from omni_rewards_testutils import save_tiny_sd3  # noqa: E402
from release_fixtures import write_dina_lrm_release  # noqa: E402

from omni_rewards import load_reward  # noqa: E402
from omni_rewards.cli import main  # noqa: E402

PROMPTS = ["a red apple", "a cat on a sofa"]


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    return save_tiny_sd3(tmp_path_factory.mktemp("sd3") / "stable-diffusion-3.5-medium")


@pytest.fixture(scope="module")
def release(tmp_path_factory, sd3):
    root = tmp_path_factory.mktemp("dina") / "DiNa-LRM-SD35M-12layers"
    tensors = write_dina_lrm_release(root, sd3)
    assert main(["convert", "dina-lrm", str(root)]) == 0
    return root, tensors


def _latents(n=2, seed=0):
    return torch.randn(n, 16, 8, 8, generator=torch.Generator().manual_seed(seed)).numpy()


def test_the_pickle_is_never_read_by_the_reward(tmp_path, sd3, capsys):
    root = tmp_path / "dina"
    write_dina_lrm_release(root, sd3)
    with pytest.raises(FileNotFoundError, match=r"omni-rewards convert dina-lrm"):
        load_reward("dina_lrm", checkpoint=str(root))
    assert main(["convert", "dina-lrm", str(root)]) == 0
    assert (root / "checkpoint" / "rm_head.safetensors").is_file()
    assert "wrote" in capsys.readouterr().out


def test_scores_latents_reproducibly(release):
    root, _ = release
    r = load_reward("dina_lrm", checkpoint=str(root))  # backbone from config.json
    out = r(latents=_latents(), prompts=PROMPTS)
    assert out.scores.shape == (2,) and np.isfinite(out.scores).all()
    np.testing.assert_allclose(out.scores, (out.details["raw"] + 10) / 10, rtol=1e-6)
    again = r(latents=_latents(), prompts=PROMPTS)
    np.testing.assert_array_equal(out.scores, again.scores)
    other = r(latents=_latents(), prompts=PROMPTS[::-1])
    assert not np.allclose(other.scores, out.scores)  # the prompt matters
    noisier = load_reward("dina_lrm", checkpoint=str(root), noise_level=0.9)
    assert not np.allclose(noisier(latents=_latents(), prompts=PROMPTS).scores, out.scores)


def test_lora_matches_peft_loading_the_same_folder(release, sd3):
    """Our LoRA injection + strict load equals peft's PeftModel.from_pretrained of the released
    backbone_lora folder on the same truncated backbone."""
    from diffusers import SD3Transformer2DModel
    from peft import PeftModel

    root, _ = release
    r = load_reward("dina_lrm", checkpoint=str(root))
    ours = r.parts["backbone"]
    base = SD3Transformer2DModel.from_pretrained(f"{sd3}/transformer")
    net = torch.nn.Module()
    net.pos_embed, net.time_text_embed = base.pos_embed, base.time_text_embed
    net.context_embedder = base.context_embedder
    net.transformer_blocks = torch.nn.ModuleList(base.transformer_blocks[:2])
    ref = PeftModel.from_pretrained(
        net, str(root / "checkpoint" / "backbone_lora"), adapter_name="rm_lora"
    )
    x = torch.randn(1, 8, 32)
    c = torch.randn(1, 5, 32)
    t = torch.randn(1, 32)
    with torch.no_grad():
        a = ours.transformer_blocks[1](hidden_states=x, encoder_hidden_states=c, temb=t)
        b = ref.base_model.model.transformer_blocks[1](
            hidden_states=x, encoder_hidden_states=c, temb=t
        )
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v)


@pytest.mark.parametrize(
    ("part", "old", "new"),
    [
        ("head", "attn1.gate_vis.2.weight", "attn1.gate_vis.1.weight"),
        (
            "lora",
            "base_model.model.transformer_blocks.0.attn2.to_q.lora_A.weight",
            "base_model.model.transformer_blocks.0.attn2.to_q.lora_a.weight",
        ),
    ],
)
def test_renamed_tensor_fails_naming_it(tmp_path, sd3, release, part, old, new):
    tensors = {k: dict(v) for k, v in release[1].items()}
    tensors[part][new] = tensors[part].pop(old)
    root = tmp_path / "bad"
    write_dina_lrm_release(root, sd3, **tensors)
    assert main(["convert", "dina-lrm", str(root)]) == 0
    with pytest.raises(ValueError) as err:
        load_reward("dina_lrm", checkpoint=str(root))
    assert new.removeprefix("base_model.model.").split(".lora")[0] in str(err.value)


def test_cli_scores_a_latent_file(release, tmp_path, capsys):
    from safetensors.numpy import save_file

    root, _ = release
    save_file({"data": _latents(2)}, str(tmp_path / "z.safetensors"))  # (N, C, H, W): N rows
    argv = ["score", "dina_lrm", str(tmp_path / "z.safetensors"), "-o", f"checkpoint={root}"]
    assert main([*argv, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    direct = load_reward("dina_lrm", checkpoint=str(root))(latents=_latents(2), prompts=PROMPTS)
    np.testing.assert_allclose(printed["scores"], direct.scores, rtol=1e-5)
