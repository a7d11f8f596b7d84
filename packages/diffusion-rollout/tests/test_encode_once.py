"""Encode once: a wave encodes each distinct prompt once and its n samples share the rows;
with guidance off the negative branch is not encoded at all.

On omni-adapters' real tiny SD3 (two CLIP text encoders and a T5), with forward hooks that
count the rows each text encoder sees. The reference is the previous per-sample encoding in
the same wave: `PerSample` tags every prompt so the wave sees 8 distinct ones, strips the tag
before the adapter's encode and leaves out ``params`` (so the "" negative is encoded too, as
before). Without omni-adapters (the standalone wheel) the SD3 tests are skipped.
"""

from __future__ import annotations

import dataclasses
import tempfile

import numpy as np
import pytest
import torch

from diffusion_rollout import RolloutRequest, SamplingParams
from diffusion_rollout.wave import denoise_wave

try:
    import omni_adapters as adapters
except ImportError:  # the standalone wheel
    adapters = None

ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


@pytest.fixture(scope="module")
def sd3():
    if adapters is None:
        pytest.skip("needs omni-adapters (the tiny SD3)")
    path = adapters.tiny.build("sd3", tempfile.mkdtemp() + "/tiny-sd3")
    model = adapters.from_pretrained(path)
    seen: dict[str, list[int]] = {name: [] for name in ENCODERS}
    for name in ENCODERS:

        def count(module, args, kwargs, name=name):
            ids = args[0] if args else kwargs["input_ids"]
            seen[name].append(int(ids.shape[0]))

        model.components[name].register_forward_pre_hook(count, with_kwargs=True)
    return model, seen


def rows_seen(seen) -> dict[str, int]:
    out = {name: sum(calls) for name, calls in seen.items()}
    for calls in seen.values():
        calls.clear()
    return out


def wave(model, reqs):
    with torch.no_grad():
        trajs, _, _ = denoise_wave(model, reqs)
    return trajs


class PerSample:
    """The model with the previous encoding: one encoder row per sample, negatives always."""

    def __init__(self, model):
        self.model = model

    def encode(self, prompts, negative_prompts=None, *, params=None):
        return self.model.encode([p.split("#")[0] for p in prompts], negative_prompts)

    def __getattr__(self, name):
        return getattr(self.model, name)


def per_sample(model, reqs):
    tagged = [dataclasses.replace(r, prompt=f"{r.prompt}#{i}") for i, r in enumerate(reqs)]
    return wave(PerSample(model), tagged)


def diff(a, b) -> float:
    """Max |a - b| over latents, log-probs and final latent, relative to max(1, |b|): the text
    encoders' row count changes float32 rounding in the last bit (guidance amplifies it)."""
    return max(
        (
            (getattr(a, n) - getattr(b, n)).abs().max() / getattr(b, n).abs().max().clamp(min=1)
        ).item()
        for n in ("latents", "log_probs", "final_latent")
    )


def requests(params, negative=None):
    """2 prompts x 4 samples, interleaved, each sample its own seed."""
    return [
        RolloutRequest(("a red cube", "a blue ball")[i % 2], 40 + i, params, f"r{i}", negative)
        for i in range(8)
    ]


def test_guidance_off_encodes_each_prompt_once_and_no_negative(sd3):
    model, seen = sd3
    p = SamplingParams(height=32, width=32, num_steps=4, sde_window_size=2, output="latent")
    reqs = requests(p)
    rows_seen(seen)
    trajs = wave(model, reqs)
    assert rows_seen(seen) == {name: 2 for name in ENCODERS}  # 2 prompts, 0 negatives
    assert all(not any(k.startswith("negative_") for k in t.condition) for t in trajs)
    # the 4 samples of a prompt share one row of the encoders' output
    assert trajs[0].condition["prompt_embeds"].data_ptr() == (
        trajs[2].condition["prompt_embeds"].data_ptr()
    )

    ref_trajs = per_sample(model, reqs)
    assert rows_seen(seen) == {name: 16 for name in ENCODERS}  # 8 prompts + 8 negatives
    for t, ref in zip(trajs, ref_trajs):
        assert diff(t, ref) <= 1e-6
        assert set(ref.condition) - set(t.condition) == {
            "negative_prompt_embeds",
            "negative_pooled_prompt_embeds",
        }
        for k, v in t.condition.items():
            assert (ref.condition[k] - v).abs().max().item() <= 1e-6, k


def test_guidance_on_encodes_each_prompt_and_negative_once(sd3):
    model, seen = sd3
    p = SamplingParams(height=32, width=32, num_steps=3, guidance_scale=4.5, output="latent")
    reqs = requests(p, negative="blurry")
    rows_seen(seen)
    trajs = wave(model, reqs)
    assert rows_seen(seen) == {name: 4 for name in ENCODERS}  # 2 prompts + 2 negatives
    ref_trajs = per_sample(model, reqs)
    assert rows_seen(seen) == {name: 16 for name in ENCODERS}
    for t, ref in zip(trajs, ref_trajs):
        assert set(t.condition) == set(ref.condition)
        assert "negative_prompt_embeds" in t.condition
        assert diff(t, ref) <= 1e-6


def test_equal_condition_images_share_one_encoding(toy_edit):
    p = SamplingParams(height=16, width=16, num_steps=2, output="latent")
    a = np.full((8, 8, 3), 7, dtype=np.uint8)
    b = np.full((8, 8, 3), 9, dtype=np.uint8)
    # same prompt, equal images in different arrays -> one row; another image -> its own row
    imgs = [a, a.copy(), b, torch.from_numpy(a.copy())]
    reqs = [RolloutRequest("edit", 5 + i, p, f"e{i}", image=im) for i, im in enumerate(imgs)]
    trajs = wave(toy_edit, reqs)
    (given,) = toy_edit.seen_images
    assert len(given) == 2
    ref = [wave(toy_edit, [r])[0] for r in reqs]
    for t, r in zip(trajs, ref):
        assert diff(t, r) <= 1e-6
        assert torch.equal(t.condition["image_latents"], r.condition["image_latents"])
