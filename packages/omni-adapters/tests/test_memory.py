"""The training-memory estimate: its formula on hand-checked numbers, and the token counts of
the published geometries."""

from __future__ import annotations

import pytest

from omni_adapters import published
from omni_adapters.memory import (
    GIB,
    activation_bytes,
    estimate_training_memory,
    largest_fitting_rows,
    model_dims,
    sequence_tokens,
)

BASE = dict(
    trainable_params=1_000_000_000,
    frozen_bytes={"text_encoder": 3 * GIB},
    trained_params=10_000_000,
    lora=True,
    hidden_size=1024,
    num_layers=10,
    tokens=1000,
    rows=4,
    rollout_rows=8,
)


def test_parts_follow_the_formula():
    est = estimate_training_memory(**BASE)
    p = est.parts
    assert p["trainable weights"] == 2e9
    assert p["frozen text_encoder"] == 3 * GIB
    assert p["LoRA + grads + AdamW"] == 16 * 10e6
    assert p["activations"] == 34 * 4 * 1000 * 1024 * 10
    assert p["rollout activations"] == 34 * 8 * 1000 * 1024
    assert p["CUDA context + slack"] == 2 * GIB
    assert est.total == pytest.approx(sum(p.values()))
    # FSDP shards the trainable component and its optimizer state, not the frozen models
    sharded = estimate_training_memory(**{**BASE, "shards": 4}).parts
    assert sharded["trainable weights"] == 0.5e9 and sharded["frozen text_encoder"] == 3 * GIB
    full = estimate_training_memory(**{**BASE, "lora": False, "trained_params": 10**9}).parts
    assert full["grads + AdamW (full)"] == 6e9
    ckpt = estimate_training_memory(**{**BASE, "gradient_checkpointing": True}).parts
    assert ckpt["activations (checkpointed)"] == 4 * 1000 * 1024 * (2 * 10 + 34)
    logits = estimate_training_memory(**{**BASE, "vocab_size": 100}).parts
    assert logits["logits"] == 8 * 4 * 1000 * 100
    with pytest.raises(ValueError, match="rows"):
        estimate_training_memory(**{**BASE, "rows": 0})


def test_activation_bytes_scale_with_rows_width_layers_and_number_size():
    # 34 bytes per token, unit of width and layer at 2 bytes per number (Korthikanti et al.)
    assert activation_bytes(1, 1000, 10) == 34 * 1000 * 10
    assert activation_bytes(3, 1000, 10) == 3 * activation_bytes(1, 1000, 10)
    assert activation_bytes(1, 1000, 10, element_bytes=4) == 2 * activation_bytes(1, 1000, 10)
    assert activation_bytes(1, 1000, 10, gradient_checkpointing=True) == 1000 * (2 * 10 + 34)


def test_largest_fitting_rows_is_the_boundary():
    gpu = 20 * GIB
    best = largest_fitting_rows(gpu, **BASE)
    assert estimate_training_memory(**{**BASE, "rows": best}).fits(gpu)
    assert not estimate_training_memory(**{**BASE, "rows": best + 1}).fits(gpu)
    assert largest_fitting_rows(1 * GIB, **BASE) == 0


def test_tokens_of_the_published_geometries():
    sd = published.load("sd35_medium").geometry
    assert sequence_tokens(sd, height=512, width=512) == 32 * 32 + 77 + 256
    wan = published.load("wan22_ti2v_5b").geometry  # VAE x16 spatial x4 temporal, patch 1x2x2
    assert sequence_tokens(wan, height=480, width=832, num_frames=33) == 15 * 26 * 9 + 512
    ltx = published.load("ltx23").geometry  # x32 spatial, x8 temporal, 25 audio latents/s
    assert sequence_tokens(ltx, height=512, width=768, num_frames=49) == 16 * 24 * 7 + 52 + 1024
    edit = published.load("qwen_image_edit_2511").geometry  # the condition image's tokens too
    assert sequence_tokens(edit, height=512, width=512) == 2 * 32 * 32 + 512
    omni = published.load("qwen3_omni_30b_a3b").geometry
    assert sequence_tokens(omni, height=0, width=0, new_tokens=1024) == 512 + 1024


def test_model_dims_read_the_configs():
    a = published.build_meta("wan22_t2v_a14b")
    assert model_dims(a.model) == (40 * 128, 40)  # one expert runs per forward
    assert model_dims(published.build_meta("sd35_medium").model) == (24 * 64, 24)
