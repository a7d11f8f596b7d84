"""Where a package may not import another (docs/architecture.md), a piece is restated; these
tests, in the package that may import both, keep each restatement equal to the original."""

from __future__ import annotations

import torch

from diffusion_rollout.wire import weights_checksum as wire_checksum
from omni_adapters import weights_checksum as adapter_checksum
from omni_adapters.testing import sde_step as adapter_sde_step
from omni_algos.sde import step as algos_step


def test_adapter_test_sde_step_equals_omni_algos_including_sigma_one() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 8, generator=g)
    v = torch.randn(3, 4, 8, 8, generator=g)
    prev = torch.randn(3, 4, 8, 8, generator=g)
    for sigma, sigma_next in [(1.0, 0.9), (0.9, 0.75), (0.5, 0.4), (0.2, 0.05)]:
        s = torch.full((3,), sigma)
        sn = torch.full((3,), sigma_next)
        for eta in (0.3, 0.7, 1.0):
            ours = adapter_sde_step(x, v, s, sn, eta, prev_sample=prev)
            ref = algos_step(x, v, s, sn, noise_level=eta, kind="sde", prev_sample=prev)
            torch.testing.assert_close(ours[1], ref.log_prob, rtol=1e-5, atol=1e-5)
            # the sample itself: the same noise through both
            gens = [torch.Generator().manual_seed(i) for i in range(3)]
            drawn = adapter_sde_step(x, v, s, sn, eta, generators=gens)[0]
            gens = [torch.Generator().manual_seed(i) for i in range(3)]
            ref = algos_step(x, v, s, sn, noise_level=eta, kind="sde", generator=gens)
            torch.testing.assert_close(drawn, ref.prev_sample, rtol=1e-5, atol=1e-5)


def test_the_two_weight_checksums_agree() -> None:
    tensors = {
        "b.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "a.lora_A": torch.ones(2, 5, dtype=torch.bfloat16),
        "c.scale": torch.tensor([1, 2, 3], dtype=torch.int64),
        "d.empty": torch.zeros(0, 3),
    }
    assert wire_checksum(tensors) == adapter_checksum(tensors)
    changed = {**tensors, "a.lora_A": torch.ones(2, 5, dtype=torch.float16)}  # dtype only
    assert wire_checksum(changed) == adapter_checksum(changed) != adapter_checksum(tensors)
