"""The weight-sync checksum has two implementations that must agree bit for bit.

docs/interfaces.md defines `weights_checksum` (sha256 over the sorted names, a NUL, the dtype
without `torch.`, the JSON shape and the raw bytes). omni-adapters computes it on the trainer's
side (`OmniModelBase.weights_checksum`, the Ray weight sync) and diffusion-rollout's wire module
on the server's (`POST /update_weights` checks it); the two packages import nothing of each other,
so each carries its own. A drift in either would make every weight sync fail (or, worse, pass on
different weights): this test holds them to one digest, and to the definition written out here.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from diffusion_rollout.wire import weights_checksum as rollout_checksum
from omni_adapters import weights_checksum as adapters_checksum


def _written_out(tensors: dict[str, torch.Tensor]) -> str:
    """docs/interfaces.md's definition, step by step."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(name.encode() + b"\0")
        h.update(str(t.dtype).removeprefix("torch.").encode())
        h.update(json.dumps(list(t.shape)).encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=g)
    return {
        "blocks.1.attn.to_q.lora_B.weight": base.t(),  # not contiguous
        "blocks.0.attn.to_q.lora_A.weight": torch.randn(3, 5, generator=g),
        "norm.weight": torch.randn(7, generator=g).to(torch.bfloat16),
        "scale": torch.tensor(2.5, dtype=torch.float16),  # a 0-d tensor
        "steps": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
    }


def test_both_packages_compute_the_documented_checksum() -> None:
    weights = _weights()
    expected = _written_out(weights)
    assert rollout_checksum(weights) == expected
    assert adapters_checksum(weights) == expected


@pytest.mark.parametrize(
    "change",
    ["value", "dtype", "shape", "name"],
)
def test_each_part_of_a_tensor_changes_both_digests_alike(change: str) -> None:
    weights = _weights()
    other = dict(weights)
    key = "blocks.0.attn.to_q.lora_A.weight"
    if change == "value":
        other[key] = weights[key].clone()
        other[key][0, 0] += 1e-6
    elif change == "dtype":
        other[key] = weights[key].double()
    elif change == "shape":
        other[key] = weights[key].reshape(5, 3)
    else:
        other[key.replace("to_q", "to_k")] = other.pop(key)
    assert rollout_checksum(other) != rollout_checksum(weights)
    assert rollout_checksum(other) == adapters_checksum(other)
