"""FSDP2 on the tiny SD3 (one-process gloo group): the wrap units shard, the sharded replay
equals the unsharded one, export gathers plain tensors and load_weights re-shards them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import omni_adapters
from omni_adapters.testing import Params, generators, perturb_lora


@pytest.fixture()
def group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_fully_shard_by_wrap_units(group, tiny_path):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ref = omni_adapters.from_pretrained(tiny_path("sd3"))
    ref.add_lora(4)
    perturb_lora(ref, seed=1)
    a = omni_adapters.from_pretrained(tiny_path("sd3"))
    a.add_lora(4)
    perturb_lora(a, seed=1)
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for m in a.fsdp_wrap_modules():
        fully_shard(m, mp_policy=mp)
    fully_shard(a.model, mp_policy=mp)
    assert type(a.trainable_parameters()[0]).__name__ == "DTensor"
    p = Params(guidance_scale=2.0)
    c = a.encode(["a cat", "a dog"])
    x = a.init_latents(2, p, generators([0, 1]))
    s = torch.tensor([0.7, 0.3])
    v = a.replay_velocity(x, s, c, p)
    v.square().mean().backward()
    vr = ref.replay_velocity(x, s, c, p)
    vr.square().mean().backward()
    torch.testing.assert_close(v, vr)
    assert all(q.grad is not None for q in a.trainable_parameters())
    w = a.export_rollout_weights()
    assert all(type(t) is torch.Tensor for t in w.values())
    assert omni_adapters.weights_checksum(w) == omni_adapters.weights_checksum(
        ref.export_rollout_weights()
    )
    perturb_lora(ref, seed=2)
    a.load_weights(ref.export_rollout_weights())
    assert omni_adapters.weights_checksum(a.export_rollout_weights()) == (
        omni_adapters.weights_checksum(ref.export_rollout_weights())
    )
    assert a.fsdp_mixed_precision().param_dtype == torch.bfloat16
