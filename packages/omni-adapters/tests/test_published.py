"""Full-size architecture checks without weights: each released model's configs
(omni_adapters/published/*.json) built on the meta device through the adapter's own
``from_pretrained(path, device="meta")``; parameter counts against the published sizes,
LoRA targets of the default target lists, FSDP wrap units, the thinker's stripping.

The expected LoRA and wrap-unit counts are worked out here from the architectures (blocks x
projections), not read back from the code under test."""

from __future__ import annotations

import pytest

from omni_adapters import published

#: model -> (default-target LoRA modules, FSDP wrap units), from the architectures:
EXPECTED = {
    # 24 joint blocks: 8 projections each, but the last block's text stream ends there
    # (context_pre_only: no to_add_out); the dual-attention attn2 of blocks 0-12 adds 4 each
    "sd35_medium": (23 * 8 + 7 + 13 * 4, 24),
    # 60 dual-stream blocks x (to_q/k/v, to_out.0, add_q/k/v, to_add_out)
    "qwen_image": (60 * 8, 60),
    "qwen_image_edit": (60 * 8, 60),
    "qwen_image_edit_2511": (60 * 8, 60),
    # self- and cross-attention x (to_q, to_k, to_v, to_out.0) per block
    "wan22_ti2v_5b": (30 * 8, 30),
    "wan22_t2v_a14b": (2 * 40 * 8, 2 * 40),  # both experts
    # 48 blocks x 6 attentions (video/audio self, text cross, a2v, v2a) x 4 projections
    "ltx23": (48 * 6 * 4, 48),
    # the generation expert's q/k/v/o in 28 MoT layers
    "bagel_7b_mot": (28 * 4, 28),
    # the text decoder's q/k/v/o in 48 layers (towers excluded); units: 48 decoder layers, 27
    # vision blocks, 32 audio encoder layers
    "qwen3_omni_30b_a3b": (48 * 4, 48 + 27 + 32),
}

#: checks whose published figure has three or more significant digits: within 1%
PRECISE = {
    "qwen_image": "transformer",
    "qwen_image_edit": "transformer",
    "qwen_image_edit_2511": "transformer",
    "bagel_7b_mot": "active LLM (embeddings + understanding expert + lm_head)",
    "qwen3_omni_30b_a3b": "full checkpoint (thinker + talker + code2wav)",
}


def test_every_family_has_a_published_model():
    families = {published.load(n).family for n in published.names()}
    assert families >= {
        "sd3",
        "qwen_image",
        "qwen_image_edit",
        "qwen_image_edit_plus",
        "wan22",
        "ltx2",
        "bagel",
        "qwen3_omni_thinker",
    }
    assert set(EXPECTED) == set(published.names())
    assert published.load("Qwen/Qwen-Image").name == "qwen_image"
    assert published.match_path("~/models/Wan2.2-TI2V-5B-Diffusers").name == "wan22_ti2v_5b"
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        published.load("nope")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_full_size_build_matches_the_published_model(name):
    model = published.load(name)
    adapter = published.build_meta(model)
    assert adapter.family == model.family
    assert adapter.model.training is False
    assert all(p.device.type == "meta" for p in adapter.model.parameters())
    results = published.run_checks(model, adapter)
    for r in results:
        print(
            f"{name}: {r.name}: {r.counted / 1e9:.3f}B vs published {r.published / 1e9:g}B "
            f"({100 * r.rel_diff:.2f}%)"
        )
        assert r.ok, (r.name, r.counted, r.published)
        if PRECISE.get(name) == r.name:
            assert r.rel_diff <= 0.01
    lora_modules, units = EXPECTED[name]
    assert len(adapter.fsdp_wrap_modules()) == units
    assert adapter.add_lora(64, 64) == lora_modules
    assert all(p.device.type == "meta" for p in adapter.trainable_parameters())


def test_thinker_is_built_without_talker_and_code2wav():
    model = published.load("qwen3_omni_30b_a3b")
    adapter = published.build_meta(model)
    assert set(adapter.components) == {"thinker"}
    names = {n.split(".")[0] for n, _ in adapter.model.named_children()}
    assert not names & {"talker", "code2wav"}
    full = published.full_transformers_model(model)
    thinker = published.checkpoint_count(adapter.model)
    others = published.checkpoint_count(full.talker) + published.checkpoint_count(full.code2wav)
    assert thinker + others == published.checkpoint_count(full) == 35_259_818_545
    assert 31e9 < thinker < 32e9  # the thinker alone: 31.7B (3.3B active per token)
