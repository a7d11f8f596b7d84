"""LoRA linears in training with the adapter folded into the weight of the matmul.

peft's ``lora.Linear`` computes ``y = W x + b + s B (A x)`` (Hu et al. 2021, LoRA; ``s`` =
alpha / rank): the base matmul, two thin matmuls, a scale and an add, each a pass over the
rows x width activations, and as many again in the backward. Folded:

    forward:   W' = W + s B A;          y = x W'^T + b                 (one matmul)
    backward:  dx = g W';   dA = s (g B)^T x;   dB = s g^T (x A^T)

with ``W`` and ``b`` frozen; ``g W'`` and ``g B`` come from one matmul, ``g [W' | B]``. The
gradients are the same sums in another order (equal to peft's up to float rounding:
``tests/test_lora_folding.py``). On 2 CPU cores a forward and backward of a (10752 x 128)
LoRA linear takes 1.35-1.8x less time than peft's (``benchmarks/training_kernels.py``).

Only what this formula covers is folded: one active plain LoRA adapter (no dropout, no DoRA
or other variant, no LoRA bias) on an ``nn.Linear`` with frozen float32 weights, and no extra
forward arguments. Anything else (adapters disabled or merged, bfloat16, where folding ``s B A``
into the weight would round the adapter's small update away) runs peft's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .instance_forward import restore_class_forward, set_instance_forward

__all__ = ["fold_lora_linears", "folded_weight", "unfold_lora_linears"]


def folded_weight(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
    """``W + s B A``: the weight of a LoRA linear with its adapter folded in (Hu et al. 2021;
    also what a merged rollout copy holds)."""
    return torch.addmm(weight, lora_b, lora_a, alpha=scaling)


class _FoldedLoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias, lora_a: Tensor, lora_b: Tensor, scaling):
        folded = folded_weight(weight, lora_a, lora_b, scaling)
        ctx.scaling = scaling
        # the parameters, not W': the backward recomputes W' (out x in x rank multiply-adds)
        # rather than hold a second copy of the weight per forward until its backward
        ctx.save_for_backward(x, weight, lora_a, lora_b)
        return nn.functional.linear(x, folded, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, lora_a, lora_b = ctx.saved_tensors
        s = ctx.scaling
        need_dx, need_a, need_b = (ctx.needs_input_grad[i] for i in (0, 3, 4))
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dx = g_b = None
        if need_dx and need_a:
            # dx = g W' and g B in one pass over g: g [W' | B], then split the columns
            both = g2 @ torch.cat([folded_weight(weight, lora_a, lora_b, s), lora_b], dim=1)
            dx = both[:, : x.shape[-1]].unflatten(0, grad.shape[:-1])
            g_b = both[:, x.shape[-1] :]
        elif need_dx:
            dx = grad @ folded_weight(weight, lora_a, lora_b, s)
        elif need_a:
            g_b = g2 @ lora_b
        # the scale goes on the thin (rows x rank) factors, not on g (a pass over all of it);
        # dB as ((s x A^T)^T g)^T: with the rank-wide factor on the left the product ran
        # 1.1-3.3x faster on 2 CPU cores than g^T (s x A^T) (benchmarks/training_kernels.py)
        d_a = (g_b * s).t() @ x2 if need_a else None
        d_b = ((x2 @ lora_a.t()).mul_(s).t() @ g2).t() if need_b else None
        return dx, None, None, d_a, d_b, None


def _folded_forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """A peft ``lora.Linear``'s forward, folded where the module docstring says it may be."""
    peft_forward = type(self).forward
    if args or kwargs or self.disable_adapters or self.merged:
        return peft_forward(self, x, *args, **kwargs)
    active = [a for a in self.active_adapters if a in self.lora_A]
    if len(active) != 1:
        return peft_forward(self, x, *args, **kwargs)
    name = active[0]
    base, lora_a, lora_b = self.base_layer, self.lora_A[name], self.lora_B[name]
    plain = (
        type(base) is nn.Linear
        and not self.fan_in_fan_out
        and name not in getattr(self, "lora_variant", {})
        and isinstance(self.lora_dropout[name], nn.Identity)
        and getattr(lora_b, "bias", None) is None
    )
    fp32 = x.dtype == base.weight.dtype == lora_a.weight.dtype == torch.float32
    frozen = not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)
    if not (plain and fp32 and frozen):
        return peft_forward(self, x, *args, **kwargs)
    return _FoldedLoRALinear.apply(
        x, base.weight, base.bias, lora_a.weight, lora_b.weight, float(self.scaling[name])
    )


def _lora_linears(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora.layer import Linear as LoraLinear

    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def fold_lora_linears(model: nn.Module) -> int:
    """Give every peft LoRA ``Linear`` of ``model`` the folded forward (module docstring);
    returns how many. Idempotent; state dicts and parameter names do not change."""
    return set_instance_forward(_lora_linears(model), _folded_forward)


def unfold_lora_linears(model: nn.Module) -> int:
    """Back to peft's own forward for every LoRA ``Linear`` of ``model``; returns how many."""
    return restore_class_forward(_lora_linears(model))
