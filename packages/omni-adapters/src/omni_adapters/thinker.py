"""`ThinkerAdapter`: the shared half of autoregressive omni models (any-to-text).

A family implements :meth:`generate` (sampling with per-token log-probs) and
:meth:`token_log_probs` (the trainer's replay of given tokens under the current weights).
The log-probs of the two must agree on the same tokens and weights; that agreement is what
the GRPO/GSPO ratio relies on.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from .base import OmniModelBase

__all__ = ["ThinkerAdapter"]


class ThinkerAdapter(OmniModelBase):
    """Base of the autoregressive (thinker) adapters."""

    modality: ClassVar[str] = "text"
    trainable_component: ClassVar[str] = "thinker"

    def generate(
        self,
        batch: Any,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | list[int] = 0,
    ) -> dict[str, Any]:
        """Sample continuations; returns at least ``tokens`` (B, T) int64, ``log_probs``
        (B, T) float32 (log-prob of each sampled token under the sampling distribution),
        ``mask`` (B, T) bool (False after EOS) and ``texts`` (list[str])."""
        raise NotImplementedError

    def token_log_probs(self, batch: Any) -> Tensor:
        """Per-token log-probs of the given completion tokens under the current weights, with
        grad, shape (B, T) float32 (trainer replay of :meth:`generate`)."""
        raise NotImplementedError
