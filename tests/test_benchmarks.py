"""benchmarks/vs_reference_loop.py: its full-size SD3.5-Medium shape is the released
architecture, its pieces fit together, and the script runs on the CPU in bfloat16.

The full-size run itself needs a GPU (benchmarks/device/vs_reference_sd35.sh); here the
transformer is counted on the meta device, and the pipeline is run with the released widths
but one layer per model.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "vs_reference_loop.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("vs_reference_loop", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sd35_medium_shape_is_the_released_transformer():
    """The transformer of ``--models sd35-medium`` has the release's config and its size.

    Count: checkpoint tensors (parameters and the persistent ``pos_embed`` buffer: what
    the released ``diffusion_pytorch_model.safetensors`` holds), 2,469,663,936. The model
    card cites "2.5 billion parameters" (2 significant digits;
    omni_adapters/published/sd35_medium.json, ``checks``): the count rounds to it, and is
    1.2 % below it, so a 1 % band around the card's figure cannot be asserted; the exact
    count is pinned instead (a changed layer count or width moves it by millions).
    """
    from omni_adapters import published

    bench = load_benchmark()
    assert bench.MODELS["sd35-medium"] == "sd35_medium"
    pipe = bench.full_size_pipeline("sd35_medium", device="meta")
    tr = pipe.transformer
    released = published.load("sd35_medium").files["transformer/config.json"]
    expected = {
        "num_layers": 24,
        "attention_head_dim": 64,
        "num_attention_heads": 24,
        "joint_attention_dim": 4096,
        "caption_projection_dim": 1536,
        "pooled_projection_dim": 2048,
        "patch_size": 2,
        "in_channels": 16,
        "out_channels": 16,
        "pos_embed_max_size": 384,
        "dual_attention_layers": tuple(range(13)),
        "qk_norm": "rms_norm",
        "sample_size": 128,
    }
    for key, value in expected.items():
        got = tr.config[key]
        got = tuple(got) if isinstance(got, list) else got
        assert got == value, key
        want = released[key]
        assert got == (tuple(want) if isinstance(want, list) else want), key
    assert all(t.device.type == "meta" for t in tr.parameters())  # no memory taken
    count = published.checkpoint_count(tr)
    assert count == 2_469_663_936
    assert round(count, -8) == 2_500_000_000  # the card's "2.5 billion"
    # the pieces that feed it have the widths it takes
    assert pipe.text_encoder_3.config.d_model == tr.config.joint_attention_dim
    clip_dims = pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim
    assert clip_dims == tr.config.pooled_projection_dim
    assert pipe.vae.config.latent_channels == tr.config.in_channels
    assert 2 ** (len(pipe.vae.config.block_out_channels) - 1) == 8


@pytest.mark.slow
def test_full_width_pipeline_runs_through_both_loaders(tmp_path):
    """The released widths with one layer each (CPU-sized), saved and loaded as each side
    of the benchmark loads it: diffusers' pipeline (the reference) and omni-adapters' SD3
    adapter (ours). A prompt encodes to 77 + 256 tokens of width 4096, the transformer
    returns a velocity of the latent's shape, the VAE decodes 8x up."""
    from diffusers import StableDiffusion3Pipeline

    from omni_adapters import from_pretrained

    bench = load_benchmark()
    torch.manual_seed(0)
    pipe = bench.full_size_pipeline(
        "sd35_medium",
        text_layers=1,
        transformer_overrides={"num_layers": 1, "dual_attention_layers": [0]},
    )
    pipe.to(torch.bfloat16)
    pipe.save_pretrained(tmp_path / "sd35", safe_serialization=True)

    ref = StableDiffusion3Pipeline.from_pretrained(tmp_path / "sd35", torch_dtype=torch.bfloat16)
    emb, _, pooled, _ = ref.encode_prompt(
        ["a red fox"], ["a red fox"], ["a red fox"], do_classifier_free_guidance=False
    )
    assert tuple(emb.shape) == (1, 77 + 256, 4096)
    assert tuple(pooled.shape) == (1, 2048)
    x = torch.randn(1, 16, 8, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        v = ref.transformer(
            hidden_states=x,
            timestep=torch.tensor([500.0]),
            encoder_hidden_states=emb,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        # in float32: a bf16 convolution on CPU has no fast kernel (82 s here, the whole test 45 s)
        img = ref.vae.float().decode(x.float(), return_dict=False)[0]
    assert v.shape == x.shape
    assert tuple(img.shape) == (1, 3, 64, 64)

    ours = from_pretrained(tmp_path / "sd35", dtype="bfloat16", device="cpu")
    cond = ours.encode_prompts(["a red fox"])
    assert tuple(cond["prompt_embeds"].shape) == (1, 77 + 256, 4096)
    torch.testing.assert_close(cond["prompt_embeds"], emb.float())
    torch.testing.assert_close(cond["pooled_prompt_embeds"], pooled.float())


@pytest.mark.slow
def test_script_runs_on_cpu_in_bfloat16():
    """``--device cpu --dtype bfloat16``: both sides train a step in bf16 and the table
    prints, with equal transformer rows on both sides; ours with `rows_per_forward: auto`;
    ``ours-base`` (ours without the LoRA, its rollout the base model's) forwards as many;
    ``ours-reuse`` (`algorithm.reuse_rollout_forward`) forwards only the rollout's rows."""
    cmd = [
        sys.executable,
        str(SCRIPT),
        *("--device", "cpu", "--dtype", "bfloat16", "--models", "tiny"),
        *("--repeats", "1", "--steps", "1", "--warmup", "0"),
        *("--prompts", "2", "--n", "2", "--batch", "4", "--num-steps", "2", "--threads", "1"),
        *("--ours-replay", "auto", "--sides", "ours,reference,ours-base,ours-reuse"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cpu, bfloat16" in out.stdout
    assert "(ours 4 rows per forward, replay auto)" in out.stdout
    assert "| tiny | step |" in out.stdout
    assert "reference / ours per step, tiny: ours " in out.stdout and ", ours-reuse " in out.stdout
    # N=4 samples x 2 steps in the rollout, 4 x 1 trained timestep in the update (none
    # with ours-reuse: its update back-propagates through the rollout's forwards)
    rows = "transformer rows forwarded per step (equal work): tiny: ours 12, reference 12, "
    assert rows + "ours-base 12, ours-reuse 8" in out.stdout
    assert "| model | phase | ours s | reference s | reference / ours | ours-base s |" in (
        out.stdout
    )
