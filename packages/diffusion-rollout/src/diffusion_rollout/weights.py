"""Checks a weight update must pass before any of its tensors is applied.

A weight update is all or nothing: `check_weights` looks at every tensor first (its name,
type, dtype, that every value is finite, and its shape against the shapes the engine already
knows), and only an update that passes all of it reaches ``denoiser.load_weights``. A rejected
update leaves the served weights and the engine's version as they were.

Non-finite values are rejected because one NaN in a LoRA factor makes every later trajectory
NaN; integer, boolean and complex dtypes because trainable weights are floating point.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["FLOAT_DTYPES", "WeightsRejected", "check_weights", "weight_shapes"]

#: the dtypes a weight update may carry (the trainer exports float32)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: elements checked for finiteness at a time (bounds the temporary bool mask)
_CHUNK = 1 << 24


class WeightsRejected(ValueError):
    """A weight update failed a check; ``field`` names the tensor (or ``"body"``)."""

    def __init__(self, message: str, field: str = "body") -> None:
        super().__init__(message)
        self.field = field


def _all_finite(t: Tensor) -> bool:
    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):
        if not bool(torch.isfinite(flat[start : start + _CHUNK]).all()):
            return False
    return True


def check_weights(
    tensors: object, known_shapes: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, Tensor]:
    """Check a whole weight update; returns it as a dict, or raises `WeightsRejected`.

    Every entry must be a non-empty string name -> dense floating-point tensor (float16,
    bfloat16, float32 or float64) whose values are all finite. A name in ``known_shapes`` (the
    shapes of earlier accepted updates) must keep its shape. The error names the first tensor
    that fails, so a caller can tell the trainer which one is wrong.
    """
    if not isinstance(tensors, Mapping):
        raise WeightsRejected(
            f"update_weights: tensors must be a dict of name -> torch.Tensor, got "
            f"{type(tensors).__name__}"
        )
    if not tensors:
        raise WeightsRejected("update_weights: the update holds no tensors")
    out: dict[str, Tensor] = {}
    for name in sorted(tensors, key=str):
        t = tensors[name]
        if not isinstance(name, str) or not name:
            raise WeightsRejected(f"update_weights: tensor name {name!r} is not a non-empty string")
        if not isinstance(t, Tensor):
            raise WeightsRejected(
                f"update_weights: tensors must be torch.Tensors; {name} is a {type(t).__name__}",
                name,
            )
        if t.layout != torch.strided or t.is_meta:
            raise WeightsRejected(f"update_weights: {name} is not a dense tensor with data", name)
        if t.dtype not in FLOAT_DTYPES:
            raise WeightsRejected(
                f"update_weights: {name} has dtype {t.dtype}; weights must be floating point "
                f"({', '.join(str(d).removeprefix('torch.') for d in FLOAT_DTYPES)})",
                name,
            )
        want = None if known_shapes is None else known_shapes.get(name)
        if want is not None and tuple(t.shape) != tuple(want):
            raise WeightsRejected(
                f"update_weights: {name} has shape {tuple(t.shape)}, expected {tuple(want)}", name
            )
        if not _all_finite(t):
            raise WeightsRejected(f"update_weights: {name} holds NaN or infinite values", name)
        out[name] = t
    return out


def weight_shapes(tensors: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    """name -> shape of an accepted update (what later updates are checked against)."""
    return {name: tuple(t.shape) for name, t in tensors.items()}
