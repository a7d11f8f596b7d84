"""The narrow ports the training loops talk to; backends differ only behind them.

- `Learner`: owns the trainable policy and its optimizer; `update` runs the algorithm's one
  update step (`omni_train.updates`) on its rank(s).
- a rollout: `DiffusionRollout` (any object with `generate_many` / `update_weights` / `stats`:
  `diffusion_rollout.EmbeddedEngine`, the Ray pool, an HTTP `RolloutClient`) or
  `TokenRollout` (a thinker's sampler).
- a reward: any callable on an `omni_rewards.RewardInput` returning a `RewardOutput`.

`Ports` bundles what a backend built for one run (`omni_train.backends.make_ports`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

__all__ = ["DiffusionRollout", "Learner", "Ports", "TokenRollout"]


class Learner(Protocol):
    """The trainable policy and its optimizer, on one process or on FSDP ranks."""

    #: ranks the update is split over (1 in one process)
    world_size: int

    def update(self, batch: Any, step: int, correction: str | None = None) -> dict[str, float]:
        """One rollout batch's optimizer steps; returns the step's metrics."""
        ...

    def rollout_weights(self) -> dict[str, Tensor]:
        """What the rollout loads for the current policy (LoRA tensors, or every trainable
        weight in full fine-tuning), whole on the caller's side."""
        ...

    def lora_export(self) -> tuple[dict[str, Tensor], dict[str, Any]] | None:
        """The LoRA in peft's format and its config (checkpoints' user-facing copy); None
        without LoRA."""
        ...

    def lora_config(self) -> dict[str, Any] | None:
        """The LoRA's config in peft's keys (``r``, ``lora_alpha``, ``target_modules``);
        None without LoRA. A served rollout model adds this adapter."""
        ...

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any] | None]:
        """(trainable tensors by name, EMA under ``ema/``; the optimizer's ``state_dict``),
        whole, for a checkpoint."""
        ...

    def load_state(self, trainable: dict[str, Tensor], optimizer: dict[str, Any] | None) -> None:
        """Inverse of `state` (the names must match: a TrainError lists what does not)."""
        ...

    def eval_weights(self) -> contextlib.AbstractContextManager[None]:
        """The weights validation samples with (the EMA when on) for the block."""
        ...

    def close(self) -> None: ...


class DiffusionRollout(Protocol):
    def generate_many(self, requests: list[Any]) -> list[Any]: ...

    def update_weights(self, tensors: dict[str, Tensor], version: int) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class TokenRollout(Protocol):
    def generate(
        self, items: list[Any], seeds: list[int], *, temperature: float, top_p: float
    ) -> dict[str, Any]:
        """``tokens`` (B, T), ``log_probs`` (B, T), ``mask`` (B, T), ``texts``,
        ``temperature``, ``forwards``, padded to `rollout.max_new_tokens`."""
        ...

    def update_weights(self, tensors: dict[str, Tensor], version: int) -> None: ...


@dataclass
class Ports:
    """What a backend built for one run."""

    learner: Any
    rollout: Any
    #: builds the reward (called after a latent reward model has been fitted, if any)
    make_reward: Callable[[], Callable[[Any], Any]]
    #: video+audio models: ``decode_av(final_latents, params) -> {frames, waveform,
    #: sample_rate}``; None where the backend cannot decode audio
    decode_av: Callable[[Tensor, Any], dict[str, Any]] | None = None
    #: is the model image-conditioned (a source image per request)?
    needs_images: bool = False
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):
                close()
        self.closers.clear()
