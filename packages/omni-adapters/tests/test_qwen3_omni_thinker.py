"""Qwen3-Omni thinker: tiny build, load, strip, LoRA, M-RoPE index, generate vs replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_adapters import from_pretrained, tiny, weights_checksum
from omni_adapters.families.qwen3_omni_thinker import Qwen3OmniThinkerAdapter

FAMILY = "qwen3_omni_thinker"


@pytest.fixture(scope="module")
def omni_path(tiny_path):
    return tiny_path(FAMILY)


@pytest.fixture(scope="module")
def adapter(omni_path):
    a = from_pretrained(omni_path)
    a.add_lora(rank=4, alpha=8)
    # LoRA B starts at zero; give it values so the adapter changes the forward
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in a.adapter_state().values():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.2)
    return a


def _image(seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 255, (16, 16, 3)).astype(np.uint8)


def _audio(seed: int = 0, n: int = 4000) -> np.ndarray:
    return np.random.RandomState(seed).randn(n).astype(np.float32)


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.flatten().double()
    b = b.flatten().double()
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def test_load_strips_talker_and_code2wav(omni_path):
    # the checkpoint really holds a talker and code2wav ...
    from safetensors import safe_open

    files = list(omni_path.glob("*.safetensors"))
    keys = set()
    for f in files:
        with safe_open(f, "pt") as fh:
            keys |= set(fh.keys())
    assert any(k.startswith("talker.") for k in keys)
    assert any(k.startswith("code2wav.") for k in keys)
    # ... and the adapter never builds them
    a = from_pretrained(omni_path)
    assert isinstance(a, Qwen3OmniThinkerAdapter)
    assert a.stage == "thinker"
    assert type(a.model).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    names = [n for n, _ in a.model.named_modules()]
    assert not any("talker" in n or "code2wav" in n for n in names)
    # the towers sit at the top (transformers <= 5.14) or under `model.` (later releases)
    leaves = {n.rsplit(".", 1)[-1] for n in names if n.count(".") <= 1}
    assert {"audio_tower", "visual", "model", "lm_head"} <= leaves
    # all frozen at load; the towers can be stripped for text-only training
    assert not any(p.requires_grad for p in a.model.parameters())
    units = [c.__name__ for c in a.fsdp_wrap_units()]
    assert units == list(a.no_split_modules)
    b = from_pretrained(omni_path, strip=["audio_tower"])
    assert not any(n.rsplit(".", 1)[-1] == "audio_tower" for n, _ in b.model.named_modules())
    assert any(n.rsplit(".", 1)[-1] == "visual" for n, _ in b.model.named_modules())
    assert "Qwen3OmniMoeAudioEncoderLayer" not in [c.__name__ for c in b.fsdp_wrap_units()]
    with pytest.raises(ValueError, match="strip"):
        from_pretrained(omni_path, strip=["no_such_tower"])


def test_lora_on_text_attention_only(omni_path):
    a = from_pretrained(omni_path)
    n = a.add_lora(rank=2)
    assert n == 2 * 4  # 2 decoder layers x q/k/v/o
    names = list(a.export_rollout_weights())
    assert names and all(k.startswith("model.layers.") for k in names)
    assert {k.split(".")[4] for k in names} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    with pytest.raises(ValueError, match="binds 0 modules"):
        a.add_lora(rank=2, target_modules=["no_such_proj"], adapter_name="bad")
    # the vllm-omni layout is the full checkpoint's (thinker under "thinker.")
    v = a.export_rollout_weights("vllm_omni")
    assert all(k.startswith("base_model.model.thinker.model.layers.") for k in v)


def test_position_ids_int64_and_audio_lengths(adapter):
    batch = adapter.build_batch(
        [[{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "what?"}]],
        images=[_image()],
        audios=[_audio(n=4000)],
    )
    pos = adapter.position_ids(batch)
    assert pos.dtype == torch.int64 and pos.shape == (3, 1, batch["input_ids"].shape[1])
    ids = batch["input_ids"][0]
    cfg = adapter.thinker.config
    audio_idx = (ids == cfg.audio_token_id).nonzero()[:, 0]
    image_idx = (ids == cfg.image_token_id).nonzero()[:, 0]
    # 25 mel frames -> 4 audio tokens, consecutive positions on all three axes
    assert len(audio_idx) == 4
    apos = pos[:, 0, audio_idx]
    assert torch.equal(apos[0], apos[1]) and torch.equal(apos[0], apos[2])
    assert torch.equal(apos[0] - apos[0, 0], torch.arange(4))
    # the image tokens get a 2-D grid (height/width differ), not a running index
    ipos = pos[:, 0, image_idx]
    assert not torch.equal(ipos[1], ipos[2])
    # the same lengths given as audio_feature_lengths reach the index identically
    alt = dict(batch)
    alt["audio_feature_lengths"] = batch["feature_attention_mask"].sum(-1)
    del alt["feature_attention_mask"]
    assert torch.equal(adapter.position_ids(alt), pos)
    # a longer clip moves every later position: the lengths do reach the index
    longer = adapter.build_batch(
        [[{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "what?"}]],
        images=[_image()],
        audios=[_audio(n=8000)],
    )
    assert adapter.position_ids(longer).max() > pos.max()
    del alt["audio_feature_lengths"]
    with pytest.raises(ValueError, match="audio_feature_lengths"):
        adapter.position_ids(alt)


def test_forward_goes_to_thinker(adapter):
    batch = adapter.build_batch(["hello"])
    out = adapter(batch)
    assert out.logits.shape == (1, batch["input_ids"].shape[1], 320)


def _check_generate_matches_replay(adapter, batch, **kw):
    out = adapter.generate(batch, max_new_tokens=8, **kw)
    toks, lp, mask = out["tokens"], out["log_probs"], out["mask"]
    assert toks.dtype == torch.int64 and lp.dtype == torch.float32
    assert toks.shape == lp.shape == mask.shape == (batch["input_ids"].shape[0], 8)
    assert len(out["texts"]) == toks.shape[0]
    replay = adapter.token_log_probs(
        {**batch, "responses": toks, "response_mask": mask, "temperature": out["temperature"]}
    )
    assert replay.requires_grad  # the LoRA tensors train through the replay
    diff = (replay.detach() - lp).abs().max().item()
    assert diff <= 1e-5, diff
    assert _pearson(replay.detach()[mask], lp[mask]) >= 0.9999
    assert (lp[mask] < 0).all()
    return out, replay


def test_generate_logprobs_match_replay_text(adapter):
    batch = adapter.build_batch(["hello there", "a much longer prompt about cats"])
    out, replay = _check_generate_matches_replay(
        adapter, batch, temperature=0.8, top_p=0.9, seed=[11, 12]
    )
    # same seeds -> same tokens; other seeds -> other tokens
    again = adapter.generate(batch, max_new_tokens=8, temperature=0.8, top_p=0.9, seed=[11, 12])
    assert torch.equal(again["tokens"], out["tokens"])
    other = adapter.generate(batch, max_new_tokens=8, temperature=0.8, top_p=0.9, seed=[5, 6])
    assert not torch.equal(other["tokens"], out["tokens"])
    # gradient reaches the trainable LoRA tensors
    replay.sum().backward()
    grads = [p.grad for p in adapter.trainable_parameters()]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    adapter.model.zero_grad(set_to_none=True)


def test_generate_logprobs_match_replay_image(adapter):
    batch = adapter.build_batch(
        [[{"type": "image"}, {"type": "text", "text": "describe"}], "plain text row"],
        images=[_image(3)],
    )
    assert "pixel_values" in batch
    _check_generate_matches_replay(adapter, batch, temperature=1.0, top_p=1.0, seed=7)
    # the image changes the answer distribution (the vision tower is wired in)
    with torch.no_grad():
        lp_img = adapter.token_log_probs({**batch, "responses": torch.zeros(2, 3).long()})
        other = adapter.build_batch(
            [[{"type": "image"}, {"type": "text", "text": "describe"}], "plain text row"],
            images=[_image(4)],
        )
        lp_other = adapter.token_log_probs({**other, "responses": torch.zeros(2, 3).long()})
    assert (lp_img[0] - lp_other[0]).abs().max() > 1e-6
    assert torch.allclose(lp_img[1], lp_other[1], atol=1e-5)


def test_generate_logprobs_match_replay_audio(adapter):
    batch = adapter.build_batch(
        [[{"type": "audio"}, {"type": "text", "text": "listen"}]], audios=[_audio(2)]
    )
    _check_generate_matches_replay(adapter, batch, temperature=1.2, top_p=0.95, seed=3)


def test_constrained_generate_matches_replay(adapter):
    """`allowed_tokens` masks generation and replay alike: only the allowed ids (plus EOS) are
    emitted and the replay of the masked distribution reproduces the rollout log-probs."""
    allowed = adapter.allowed_token_ids(["A", "B", "C", "D"])
    letters = {adapter.tokenizer.convert_tokens_to_ids(c) for c in "ABCD"}
    eos = set(adapter._eos_ids())
    assert set(allowed) == letters | eos
    batch = adapter.build_batch(
        [[{"type": "image"}, {"type": "text", "text": "count"}], "plain text row", "third"],
        images=[_image(5)],
    )
    out = adapter.generate(
        batch, max_new_tokens=6, temperature=1.3, top_p=0.95, seed=4, allowed_tokens=allowed
    )
    toks, lp, mask = out["tokens"], out["log_probs"], out["mask"]
    assert set(toks[mask].tolist()) <= set(allowed)
    assert all(set(t) <= set("ABCD") for t in out["texts"])
    rb = {**batch, "responses": toks, "response_mask": mask, "temperature": out["temperature"]}
    replay = adapter.token_log_probs({**rb, "allowed_tokens": allowed})
    assert (replay.detach() - lp).abs().max().item() < 1e-4
    # the masked distribution is renormalised over the allowed ids: its log-probs are higher
    # than the unconstrained ones of the same tokens (which the replay must not mix up)
    free = adapter.token_log_probs(rb).detach()
    assert (lp[mask] > free[mask] + 1e-3).all()
    # grads still flow through the masked replay
    replay.sum().backward()
    assert any(
        p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.trainable_parameters()
    )
    adapter.model.zero_grad(set_to_none=True)
    # greedy under the mask picks the allowed id with the largest logit
    g = adapter.generate(batch, max_new_tokens=1, temperature=0.0, allowed_tokens=allowed)
    with torch.no_grad():
        z = adapter(batch).logits[:, -1].float()
    best = torch.tensor(allowed)[z[:, allowed].argmax(-1)]
    assert torch.equal(g["tokens"][:, 0], best)


def test_allowed_token_ids_errors(adapter):
    with pytest.raises(ValueError, match="allowed_tokens: '' "):
        adapter.allowed_token_ids(["A", ""])
    with pytest.raises(ValueError, match="allowed_tokens: a list of strings"):
        adapter.allowed_token_ids("ABCD")
    with pytest.raises(ValueError, match="cannot emit"):
        adapter.allowed_token_ids(["<|image_pad|>"])
    # multi-token strings contribute each of their tokens; EOS is always allowed
    ids = adapter.allowed_token_ids(["ab"])
    assert set(ids) == set(adapter.tokenizer.encode("ab", add_special_tokens=False)) | set(
        adapter._eos_ids()
    )
    batch = adapter.build_batch(["hi"])
    with pytest.raises(ValueError, match="allowed_tokens"):
        adapter.generate(batch, max_new_tokens=1, allowed_tokens=[10_000])


def test_greedy_and_eos_mask(adapter):
    batch = adapter.build_batch(["hi"])
    a = adapter.generate(batch, max_new_tokens=4, temperature=0.0, seed=0)
    b = adapter.generate(batch, max_new_tokens=4, temperature=0.0, seed=99)
    assert torch.equal(a["tokens"], b["tokens"])
    with pytest.raises(ValueError, match="top_p"):
        adapter.generate(batch, max_new_tokens=4, top_p=0.0)
    # masked tokens get log-prob 0 in the replay
    toks = a["tokens"]
    mask = torch.tensor([[True, True, False, False]])
    lp = adapter.token_log_probs({**batch, "responses": toks, "response_mask": mask})
    assert (lp[0, 2:] == 0).all() and (lp[0, :2] < 0).all()


def test_export_import_round_trip(omni_path, adapter):
    w = adapter.export_rollout_weights()
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in w.values())
    fresh = from_pretrained(omni_path)
    fresh.add_lora(rank=4, alpha=8)
    assert weights_checksum(fresh.export_rollout_weights()) != weights_checksum(w)
    fresh.load_weights(adapter.export_rollout_weights("vllm_omni"))
    assert weights_checksum(fresh.export_rollout_weights()) == weights_checksum(w)
    batch = adapter.build_batch(["sync check"])
    resp = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        x = adapter.token_log_probs({**batch, "responses": resp})
        y = fresh.token_log_probs({**batch, "responses": resp})
    assert torch.equal(x, y)
    # the reference policy (adapters disabled) is a different distribution
    with torch.no_grad(), adapter.disabled_adapters():
        ref = adapter.token_log_probs({**batch, "responses": resp})
    assert (ref - x).abs().max() > 1e-6


def test_tiny_build_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    a = tiny.build(FAMILY, tmp_path / "a", seed=0)
    b = tiny.build(FAMILY, tmp_path / "b", seed=0)
    wa = {k: v for f in a.glob("*.safetensors") for k, v in load_file(f).items()}
    wb = {k: v for f in b.glob("*.safetensors") for k, v in load_file(f).items()}
    assert weights_checksum(wa) == weights_checksum(wb)
    n = sum(v.numel() for k, v in wa.items() if k.startswith("thinker."))
    assert 10_000 < n < 1_000_000
