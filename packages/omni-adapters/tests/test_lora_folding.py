"""The folded LoRA training forward (`omni_adapters.lora_folding`) against peft's own forward
on the tiny SD3 (the real diffusers transformer with peft's LoRA layers): equal velocities
and LoRA gradients in float32; peft's forward, bit for bit, wherever the fold does not apply
(adapters disabled, bfloat16, LoRA dropout); parameter names unchanged."""

from __future__ import annotations

import pytest
import torch

import omni_adapters
from omni_adapters.lora_folding import fold_lora_linears, unfold_lora_linears
from omni_adapters.testing import Params, autograd_node_names, generators, perturb_lora


def _replay(adapter, prompts=("a cat", "a red cube", "a dog")):
    """A training replay's velocity of 3 rows at 3 sigmas, and the LoRA gradients of a loss."""
    p = Params()
    c = adapter.encode(list(prompts))
    x = adapter.init_latents(len(prompts), p, generators([0, 1, 2]))
    sig = torch.tensor([0.9, 0.5, 0.2])
    for q in adapter.trainable_parameters():
        q.grad = None
    v = adapter.replay_velocity(x, sig, c, p)
    folded = "_FoldedLoRALinearBackward" in autograd_node_names(v)
    (v.square().mean() + v.mean()).backward()
    return (
        folded,
        v.detach(),
        {n: q.grad.clone() for n, q in adapter.model.named_parameters() if q.grad is not None},
    )


def _adapter(tiny_path, dtype=torch.float32, dropout=0.0):
    a = omni_adapters.from_pretrained(tiny_path("sd3"), dtype=dtype)
    assert a.add_lora(4, dropout=dropout) > 0
    perturb_lora(a, seed=3)
    return a


def test_folded_gradients_equal_peft(tiny_path):
    a = _adapter(tiny_path)
    names = [n for n, _ in a.model.named_parameters()]
    was_folded, v_fold, g_fold = _replay(a)
    assert unfold_lora_linears(a.model) > 0
    assert [n for n, _ in a.model.named_parameters()] == names  # nothing renamed or added
    was_peft, v_peft, g_peft = _replay(a)
    assert was_folded and not was_peft
    torch.testing.assert_close(v_fold, v_peft, rtol=1e-5, atol=1e-6)
    assert g_fold.keys() == g_peft.keys() and len(g_peft) > 0
    assert all("lora_" in n for n in g_peft)  # only the adapter trains
    for n in g_peft:
        scale = g_peft[n].abs().max()
        assert (g_fold[n] - g_peft[n]).abs().max() <= 1e-5 * scale + 1e-9, n
    # folding again is idempotent and gives the folded result back
    assert fold_lora_linears(a.model) == fold_lora_linears(a.model)
    _, v_again, _ = _replay(a)
    torch.testing.assert_close(v_again, v_fold, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["disabled", "bfloat16", "dropout"])
def test_peft_forward_where_the_fold_does_not_apply(tiny_path, case):
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    a = _adapter(tiny_path, dtype=dtype, dropout=0.1 if case == "dropout" else 0.0)
    p = Params()
    c = a.encode(["a cat"])
    x = a.init_latents(1, p, generators([0]))
    sig = torch.tensor([0.6])

    def velocity():
        torch.manual_seed(0)  # the dropout masks, where there are any
        if case == "disabled":
            with torch.no_grad(), a.disabled_adapters():
                return a.velocity(x, sig, c, p)
        return a.replay_velocity(x, sig, c, p).detach()

    folded = velocity()
    unfold_lora_linears(a.model)
    assert torch.equal(folded, velocity())


@pytest.mark.parametrize("input_grad", [True, False])
@pytest.mark.parametrize("trained", ["both", "lora_A", "lora_B"])
def test_each_gradient_the_backward_may_skip(input_grad, trained):
    """The folded backward computes only the gradients autograd asks for (the input's, A's,
    B's, in every combination) and each equals peft's."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False)
    model = inject_adapter_in_model(cfg, model)
    for name, q in model.named_parameters():
        q.requires_grad_("lora_" in name and trained in ("both", name.split(".")[-3]))
    x0, g = torch.randn(2, 7, 12), torch.randn(2, 7, 20)

    def grads() -> dict[str, torch.Tensor]:
        x = x0.clone().requires_grad_(input_grad)
        for q in model.parameters():
            q.grad = None
        model(x).backward(g)
        out = {n: q.grad for n, q in model.named_parameters() if q.grad is not None}
        return {**out, **({"x": x.grad} if input_grad else {})}

    assert fold_lora_linears(model) == 1
    folded = grads()
    unfold_lora_linears(model)
    peft = grads()
    assert (
        folded.keys() == peft.keys() and len(peft) == (2 if trained == "both" else 1) + input_grad
    )
    for n in peft:
        torch.testing.assert_close(folded[n], peft[n], rtol=1e-5, atol=1e-6)
