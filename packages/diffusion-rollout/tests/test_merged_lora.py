"""Merged-LoRA rollout: the engine samples the LoRA policy with the adapter merged into the
base weights (``W0 + scale * B @ A``), while the trainer keeps its unmerged peft model.

On omni-adapters' real tiny SD3 in float32: the merged copy's trajectories and log-probs equal
the unmerged policy's; a weight update merges from the kept base weights (never on top of the
last merge); a wave in flight finishes on the version it started with. Without omni-adapters
(the standalone wheel) these tests are skipped.
"""

from __future__ import annotations

import tempfile
import threading
import time

import pytest
import torch

from diffusion_rollout import EmbeddedEngine, RolloutRequest, SamplingParams
from diffusion_rollout.wave import denoise_wave

try:
    from peft.tuners.tuners_utils import BaseTunerLayer

    import omni_adapters as adapters
except ImportError:  # the standalone wheel
    adapters = None

P = SamplingParams(
    height=32, width=32, num_steps=4, sde_window_size=2, sde_window_range=(0, 3), output="latent"
)


@pytest.fixture(scope="module")
def tiny_sd3():
    if adapters is None:
        pytest.skip("needs omni-adapters (the tiny SD3)")
    return adapters.tiny.build("sd3", tempfile.mkdtemp() + "/tiny-sd3")


def policy(path):
    """The trainer's side: the tiny SD3 with the family's default LoRA targets."""
    model = adapters.from_pretrained(path)
    model.add_lora(4, 8.0)
    return model


def random_lora(model, seed):
    """Exported LoRA tensors with random nonzero A and B (what a trained policy pushes)."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: 0.3 * torch.randn(v.shape, generator=g)
        for k, v in model.export_rollout_weights().items()
    }


def reqs(tag="q"):
    return [RolloutRequest(f"a cat {i % 2}", 10 + i, P, f"{tag}{i}") for i in range(4)]


def wave(model, requests):
    with torch.no_grad():
        trajs, _, _ = denoise_wave(model, requests)
    return trajs


def max_diff(a, b):
    return max(
        (getattr(x, n) - getattr(y, n)).abs().max().item()
        for x, y in zip(a, b)
        for n in ("latents", "log_probs", "final_latent")
    )


def test_merged_rollout_equals_the_unmerged_policy(tiny_sd3):
    trainer = policy(tiny_sd3)
    trainer.load_weights(random_lora(trainer, 1))
    rollout = trainer.merged_rollout_copy()
    assert rollout.is_merged and not trainer.is_merged
    # the rollout copy runs plain layers; the trainer keeps its peft layers
    assert not any(isinstance(m, BaseTunerLayer) for m in rollout.model.modules())
    assert any(isinstance(m, BaseTunerLayer) for m in trainer.model.modules())
    # every tensor but the merged layers' weights is the trainer's own (no second model)
    own = {id(p) for p in trainer.model.parameters()}
    copied = [n for n, p in rollout.model.named_parameters() if id(p) not in own]
    assert copied and all(n.endswith(".weight") for n in copied)
    assert len(copied) == len(rollout.merged_layers)
    extra = sum(p.numel() for n, p in rollout.model.named_parameters() if id(p) not in own)
    assert extra == trainer.lora_base_params()  # what `omni-train validate --memory` counts

    ref = wave(trainer, reqs())
    got = wave(rollout, reqs())
    assert max_diff(got, ref) <= 1e-5
    assert max_diff(got, wave(adapters.from_pretrained(tiny_sd3), reqs())) > 1e-3  # LoRA acts
    # export gives back what was merged (the weight-sync checksum compares it)
    assert adapters.weights_checksum(rollout.export_rollout_weights()) == (
        adapters.weights_checksum(trainer.export_rollout_weights())
    )
    # the trainer trains on: a sync merges its new tensors
    trainer.load_weights(random_lora(trainer, 2))
    rollout.load_weights(trainer.export_rollout_weights())
    assert max_diff(wave(rollout, reqs()), wave(trainer, reqs())) <= 1e-5


def test_merging_again_never_accumulates(tiny_sd3):
    trainer = policy(tiny_sd3)
    rollout = trainer.merged_rollout_copy()
    base = {n: m.layer.weight.clone() for n, m in rollout.merged_layers.items()}
    for name, m in rollout.merged_layers.items():  # B = 0 at first: the base model
        assert torch.equal(m.layer.weight, trainer.model.get_submodule(name).base_layer.weight)
    w1, w2 = random_lora(trainer, 1), random_lora(trainer, 2)
    rollout.load_weights(w1)
    once = {n: m.layer.weight.clone() for n, m in rollout.merged_layers.items()}
    rollout.load_weights(w1)
    rollout.load_weights(w2)
    rollout.load_weights(w1)
    for n, m in rollout.merged_layers.items():
        assert torch.equal(m.layer.weight, once[n]), n
        assert not torch.equal(m.layer.weight, base[n]), n
    zero_b = {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in w2.items()}
    rollout.load_weights(zero_b)
    for n, m in rollout.merged_layers.items():  # the base weights come back bit for bit
        assert torch.equal(m.layer.weight, base[n]), n
    # a rejected update changes nothing
    bad = {**w1, next(iter(w1)): torch.full_like(next(iter(w1.values())), float("nan"))}
    with pytest.raises(ValueError, match="NaN"):
        rollout.load_weights(bad)
    for n, m in rollout.merged_layers.items():
        assert torch.equal(m.layer.weight, base[n]), n
    with pytest.raises(ValueError, match="merged"):
        rollout.add_lora(2)
    with pytest.raises(ValueError, match="merged"), rollout.disabled_adapters():
        pass


def test_a_wave_in_flight_keeps_its_version(tiny_sd3):
    trainer = policy(tiny_sd3)
    w1, w2 = random_lora(trainer, 1), random_lora(trainer, 2)
    rollout = trainer.merged_rollout_copy()
    rollout.load_weights(w1)
    ref1 = wave(rollout, reqs())
    rollout.load_weights(w2)
    ref2 = wave(rollout, reqs())
    rollout.load_weights(w1)

    started = threading.Event()
    forward = rollout.velocity

    def velocity(*args, **kwargs):
        if not started.is_set():  # the wave's first forward: let the update try to cut in
            started.set()
            time.sleep(0.3)
        return forward(*args, **kwargs)

    rollout.velocity = velocity
    with EmbeddedEngine(rollout, max_num_seqs=4) as engine:
        futs = engine.submit_many(reqs("a"))
        assert started.wait(60)
        update = threading.Thread(target=engine.update_weights, args=(w2, 1))
        update.start()  # waits for the wave; no forward of it sees version 1's weights
        first = [f.result(60) for f in futs]
        update.join(60)
        second = engine.generate_many(reqs("b"))
    assert {t.version for t in first} == {0} and {t.version for t in second} == {1}
    assert max_diff(first, ref1) <= 1e-5
    assert max_diff(second, ref2) <= 1e-5
    assert max_diff(ref1, ref2) > 1e-3
