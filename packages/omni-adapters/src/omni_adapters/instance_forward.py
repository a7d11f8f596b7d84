"""Give some modules of a model another ``forward``, per instance, and take it back.

The training-forward kernels (`lora_folding`, `rms_norm_fusing`) replace the forward of the
library modules they cover (peft's LoRA ``Linear``, diffusers' ``RMSNorm``) on the instances
of one model only: the instance attribute shadows the class's method, so state dicts,
parameter names, hooks and other models are untouched, and ``copy.deepcopy`` of the model
binds the copy's forward to the copied module. A replacement decides per call whether it
applies and otherwise calls the class's own forward.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable

from torch import nn

__all__ = ["restore_class_forward", "set_instance_forward"]


def set_instance_forward(modules: Iterable[nn.Module], forward: Callable) -> int:
    """Bind ``forward`` as the forward of each module; returns how many. Idempotent."""
    n = 0
    for module in modules:
        module.forward = types.MethodType(forward, module)
        n += 1
    return n


def restore_class_forward(modules: Iterable[nn.Module]) -> int:
    """Drop each module's instance forward (its class's runs again); returns how many."""
    n = 0
    for module in modules:
        module.__dict__.pop("forward", None)
        n += 1
    return n
