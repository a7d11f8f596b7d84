"""The fused RMSNorm (`omni_adapters.rms_norm_fusing`) against diffusers' own ``RMSNorm``: the
same output bit for bit in float32 and the same input gradient to float rounding, with and
without a weight, on a strided input (the q/k heads are a transposed view); diffusers' forward,
bit for bit, wherever the fusion does not apply; and on the tiny SD3 (qk_norm "rms_norm"),
the LoRA policy's replay through the fused norms gives the unfused velocity and gradients."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.normalization import RMSNorm

import omni_adapters
from omni_adapters.rms_norm_fusing import fuse_rms_norms, unfuse_rms_norms
from omni_adapters.testing import Params, autograd_node_names, generators, perturb_lora


def _norm_and_grad(norm: torch.nn.Module, x0: torch.Tensor, g: torch.Tensor):
    x = x0.detach().clone().requires_grad_(True)
    y = norm(x)
    y.backward(g)
    return y.detach(), x.grad, "_FusedRMSNormBackward" in autograd_node_names(y)


@pytest.mark.parametrize("affine", [True, False])
def test_fused_equals_diffusers(affine):
    torch.manual_seed(0)
    norm = torch.nn.Sequential(RMSNorm(32, eps=1e-6, elementwise_affine=affine))
    if affine:
        with torch.no_grad():
            norm[0].weight.normal_()
        norm[0].weight.requires_grad_(False)
    x0 = torch.randn(6, 10, 4, 32).transpose(1, 2)  # (batch, heads, tokens, head_dim), strided
    g = torch.randn(6, 4, 10, 32)
    assert fuse_rms_norms(norm) == 1
    y_f, dx_f, fused = _norm_and_grad(norm, x0, g)
    assert unfuse_rms_norms(norm) == 1
    y_d, dx_d, unfused = _norm_and_grad(norm, x0, g)
    assert fused and not unfused
    assert torch.equal(y_f, y_d)
    torch.testing.assert_close(dx_f, dx_d, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["trained_weight", "bfloat16", "bias"])
def test_diffusers_forward_where_the_fusion_does_not_apply(case):
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6, bias=case == "bias")
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    norm = norm.to(dtype)
    if case != "trained_weight":
        norm.weight.requires_grad_(False)
    x0 = torch.randn(3, 5, 16, dtype=dtype)
    g = torch.randn(3, 5, 16, dtype=dtype)
    fuse_rms_norms(norm)
    y_f, dx_f, fused = _norm_and_grad(norm, x0, g)
    unfuse_rms_norms(norm)
    y_d, dx_d, _ = _norm_and_grad(norm, x0, g)
    assert not fused
    assert torch.equal(y_f, y_d) and torch.equal(dx_f, dx_d)


def test_lora_replay_through_fused_norms_on_the_tiny_sd3(tiny_path):
    a = omni_adapters.from_pretrained(tiny_path("sd3"))
    assert a.add_lora(4) > 0  # fuses the RMSNorms with the LoRA fold
    perturb_lora(a, seed=3)
    p, sig = Params(), torch.tensor([0.9, 0.4])
    c = a.encode(["a cat", "a red cube"])
    x = a.init_latents(2, p, generators([0, 1]))

    def replay():
        for q in a.trainable_parameters():
            q.grad = None
        v = a.replay_velocity(x, sig, c, p)
        v.square().mean().backward()
        grads = {n: q.grad.clone() for n, q in a.model.named_parameters() if q.grad is not None}
        return v.detach(), grads, "_FusedRMSNormBackward" in autograd_node_names(v)

    v_f, g_f, fused = replay()
    assert unfuse_rms_norms(a.model) > 0
    v_d, g_d, unfused = replay()
    assert fused and not unfused
    assert torch.equal(v_f, v_d)  # the forward is diffusers' to the bit
    assert g_f.keys() == g_d.keys() and g_d
    for n in g_d:
        assert (g_f[n] - g_d[n]).abs().max() <= 1e-5 * g_d[n].abs().max() + 1e-9, n
