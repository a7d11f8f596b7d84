"""diffusers' ``RMSNorm`` (the q/k norms of SD3.5's and Qwen-Image's attention; Wan's are
torch's own ``nn.RMSNorm``, left alone) in one fused kernel forward and a hand-written backward.

RMSNorm (Zhang & Sennrich 2019) over the last dimension of size ``d``, weight ``w`` frozen:

    forward:   r = (mean(x^2) + eps)^(-1/2);   y = x r w
    backward:  dx = r (g w) - x r^3 ((g w) . x) / d

diffusers computes the forward as five elementwise passes (square, mean, rsqrt, two products)
that autograd records and replays backwards one by one; on a CPU each pass over a large
activation costs a trip through memory. Here the forward is torch's fused
``aten::_fused_rms_norm`` (it also returns ``r``, bit for bit diffusers' output in float32)
and the backward the two-line formula above (equal to autograd's to float rounding:
``tests/test_rms_norm_fusing.py``). On 2 CPU cores a forward and backward over the q/k heads
of a packed replay forward, (336, 4, 16 or 32, 32), takes 1.3-1.5x less time than diffusers'
(``benchmarks/training_kernels.py``).

Only what this covers is fused: float32 input and weight (or no weight), no bias, one
normalized dimension, a weight that does not train, and a torch that has the fused kernel.
Anything else runs diffusers' own forward.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .instance_forward import restore_class_forward, set_instance_forward

__all__ = ["fuse_rms_norms", "unfuse_rms_norms"]

_HAS_KERNEL = hasattr(torch.ops.aten, "_fused_rms_norm")


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, rstd = ctx.saved_tensors
        gw = grad if weight is None else grad * weight
        dot = torch.linalg.vecdot(gw, x).unsqueeze(-1)  # (g w) . x, one fused pass
        coef = rstd.pow(3).mul_(dot).div_(-x.shape[-1])
        return torch.addcmul(gw * rstd, x, coef), None, None


def _fused_forward(self, hidden_states: Tensor) -> Tensor:
    """A diffusers ``RMSNorm``'s forward, fused where the module docstring says it may be."""
    w = self.weight
    plain = (
        _HAS_KERNEL
        and self.bias is None
        and len(self.dim) == 1
        and hidden_states.dtype == torch.float32
        and (w is None or (w.dtype == torch.float32 and not w.requires_grad))
    )
    if not plain:
        return type(self).forward(self, hidden_states)
    return _FusedRMSNorm.apply(hidden_states, w, float(self.eps))


def _rms_norms(model: nn.Module) -> list[nn.Module]:
    from diffusers.models.normalization import RMSNorm

    return [m for m in model.modules() if type(m) is RMSNorm]


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every diffusers ``RMSNorm`` of ``model`` the fused forward (module docstring);
    returns how many. Idempotent; state dicts and parameter names do not change."""
    return set_instance_forward(_rms_norms(model), _fused_forward)


def unfuse_rms_norms(model: nn.Module) -> int:
    """Back to diffusers' own forward for every ``RMSNorm`` of ``model``; returns how many."""
    return restore_class_forward(_rms_norms(model))
