"""`ThinkerAdapter`: the shared half of autoregressive omni models (any-to-text).

A family implements :meth:`generate` (sampling with per-token log-probs) and
:meth:`token_log_probs` (the trainer's replay of given tokens under the current weights).
The log-probs of the two must agree on the same tokens and weights; that agreement is what
the GRPO/GSPO ratio relies on.

Constrained decoding: ``generate(..., allowed_tokens=ids)`` and a replay batch with
``"allowed_tokens": ids`` both set every logit outside ``ids`` to ``-inf`` before the softmax,
so the sampled tokens and their log-probs come from (and are replayed under) the same masked
distribution. :meth:`allowed_token_ids` turns strings (e.g. the choice letters) into such ids.
"""

from __future__ import annotations

from collections.abc import Sequence
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
        allowed_tokens: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """Sample continuations; returns at least ``tokens`` (B, T) int64, ``log_probs``
        (B, T) float32 (log-prob of each sampled token under the sampling distribution),
        ``mask`` (B, T) bool (False after EOS) and ``texts`` (list[str]). With
        ``allowed_tokens`` (token ids) only those ids can be sampled and the log-probs are
        those of the distribution renormalised over them."""
        raise NotImplementedError

    def token_log_probs(self, batch: Any) -> Tensor:
        """Per-token log-probs of the given completion tokens under the current weights, with
        grad, shape (B, T) float32 (trainer replay of :meth:`generate`; a batch key
        ``allowed_tokens`` replays the same masked distribution)."""
        raise NotImplementedError

    def allowed_token_ids(self, strings: Sequence[str]) -> list[int]:
        """The sorted token ids that the strings tokenize to (their union), plus the EOS id(s)
        so a constrained response can still end; ``ValueError`` naming the string when one
        maps to no usable token."""
        raise NotImplementedError
