"""Every registered loss runs forward and backward on random inputs with finite results."""

import math

import pytest
import torch

from omni_algos.losses import LOSSES

B, SHAPE = 4, (3, 4, 4)


def _inputs(name, g):
    """Leaf tensors that need grad, and a call of the loss on them."""
    lp = (torch.randn(B, generator=g) * 0.01).requires_grad_(True)
    old = torch.randn(B, generator=g) * 0.01
    adv = torch.randn(B, generator=g)
    mean = torch.randn(B, *SHAPE, generator=g).requires_grad_(True)
    old_mean = mean.detach() + 0.01 * torch.randn(B, *SHAPE, generator=g)
    std, sdt = torch.rand(B, generator=g) + 0.1, torch.rand(B, generator=g) + 0.1
    v = torch.randn(B, *SHAPE, generator=g).requires_grad_(True)
    v2 = torch.randn(B, *SHAPE, generator=g).requires_grad_(True)
    x = [torch.randn(B, *SHAPE, generator=g) for _ in range(4)]
    tok_lp = (torch.randn(B, 7, generator=g) - 1).requires_grad_(True)
    tok_old = tok_lp.detach() + 1e-4 * torch.randn(B, 7, generator=g)
    tok_mask = (torch.rand(B, 7, generator=g) > 0.3).float()
    calls = {
        "flow_grpo": ([lp], lambda: LOSSES[name](lp, old, adv)),
        "dance_grpo": ([lp], lambda: LOSSES[name](lp, old, adv)),
        "mix_grpo": ([lp], lambda: LOSSES[name](lp, old, adv)),
        "flow_dppo": (
            [lp, mean],
            lambda: LOSSES[name](lp, old, adv, mean, old_mean, std=std, sqrt_dt=sdt),
        ),
        "grpo_guard": ([lp, mean], lambda: LOSSES[name](lp, old, adv, mean, old_mean, std, sdt)),
        "diffusion_nft": (
            [v],
            lambda: LOSSES[name](
                v,
                x[0],
                x[1],
                x[2],
                torch.rand(B, generator=g),
                adv,
                ref_velocity=x[3],
                kl_weight=0.1,
            ),
        ),
        "diffusion_dpo": (
            [v, v2],
            lambda: LOSSES[name](v, v2, x[0], x[1], x[2], x[3], mean.detach()),
        ),
        "grpo": ([tok_lp], lambda: LOSSES[name](tok_lp, tok_old, adv, tok_mask)),
        "gspo": ([tok_lp], lambda: LOSSES[name](tok_lp, tok_old, adv, tok_mask)),
    }
    return calls[name]


def test_all_design_names_registered():
    want = {
        "flow_grpo",
        "dance_grpo",
        "flow_dppo",
        "mix_grpo",
        "grpo_guard",
        "diffusion_nft",
        "diffusion_dpo",
        "grpo",
        "gspo",
    }
    assert want <= set(LOSSES)
    # the KL terms are added to a loss, they are no algorithm of their own
    assert "kl_penalty" not in LOSSES and "k3_kl" not in LOSSES


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_forward_backward_finite(name):
    leaves, call = _inputs(name, torch.Generator().manual_seed(0))
    out = call()
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    assert any(leaf.grad is not None and leaf.grad.abs().sum() > 0 for leaf in leaves)
    for leaf in leaves:
        assert leaf.grad is None or torch.isfinite(leaf.grad).all()
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.metrics.values())


def test_bfloat16_inputs_are_computed_in_float32():
    g = torch.Generator().manual_seed(1)
    lp, old, adv = (
        torch.randn(B, generator=g),
        torch.randn(B, generator=g),
        torch.randn(B, generator=g),
    )
    a = LOSSES["flow_grpo"](lp.bfloat16(), old.bfloat16(), adv.bfloat16(), clip_range=0.2)
    b = LOSSES["flow_grpo"](
        lp.bfloat16().float(), old.bfloat16().float(), adv.bfloat16().float(), clip_range=0.2
    )
    assert a.loss.dtype == torch.float32 and a.loss.item() == b.loss.item()
