"""The `Denoiser` protocol the engine drives, the `Trajectory` it returns, and errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from .params import SamplingParams

__all__ = [
    "Denoiser",
    "EngineClosed",
    "RequestAborted",
    "Trajectory",
    "VersionMismatchError",
    "stack_conditions",
]


class VersionMismatchError(RuntimeError):
    """A request asked for a weights version the engine does not have (any more, or in time),
    or a trajectory came back on a version other than the one asked for."""


class RequestAborted(RuntimeError):
    """The engine dropped a request before running it (`abort`, `close`); safe to retry."""


class EngineClosed(RequestAborted):
    """The engine was closed; its pending requests are aborted."""


@runtime_checkable
class Denoiser(Protocol):
    """What the engine needs from a diffusion model (see docs/interfaces.md).

    omni_adapters' diffusion adapters satisfy it structurally (they never import this).
    ``params`` is read by attribute only (height, width, num_frames, num_steps,
    guidance_scale, true_cfg_scale).
    """

    def encode(
        self, prompts: list[str], negative_prompts: list[str] | None = None, *, params: Any = None
    ) -> dict[str, Tensor]:
        """Batch-first condition tensors of fixed per-row shape; ``negative_*`` keys hold the
        negative branch ("" when ``negative_prompts`` is None). The engine passes the rows'
        sampling ``params``; with guidance off the denoiser may leave the negative branch out
        (its ``velocity`` then never reads it). The engine encodes each distinct prompt of a
        wave once and shares the rows among that prompt's samples.

        An image-conditioned denoiser sets the class attribute ``needs_images = True`` and
        takes ``encode(prompts, negative_prompts, images=...)``: the requests' condition
        images as one uint8 (B, H, W, 3) tensor, or a list of (H, W, 3) tensors of different
        sizes, that it resizes itself."""
        ...

    def init_latents(self, batch: int, params: Any, generators: list[torch.Generator]) -> Tensor:
        """Initial noise; row ``b`` drawn from ``generators[b]`` alone."""
        ...

    def sigmas(self, params: Any) -> Tensor:
        """(num_steps + 1,) float32 schedule from ~1 down to 0."""
        ...

    def velocity(
        self, latents: Tensor, sigma: Tensor, condition: dict[str, Tensor], params: Any
    ) -> Tensor:
        """Velocity at (latents, sigma (B,)); CFG applied inside, branches packed."""
        ...

    def decode(self, latents: Tensor) -> Tensor:
        """uint8 media, channels last: (B, H, W, 3) or (B, F, H, W, 3)."""
        ...

    def load_weights(self, tensors: dict[str, Tensor]) -> None:
        """Load trainable (LoRA) weights pushed by the trainer."""
        ...


def stack_conditions(rows: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Stack per-row condition dicts (``Trajectory.condition``) into one batch-first dict.

    Every row must have the same keys and per-key shapes (adapters pad text to a fixed
    length); the error names the first key that differs.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("stack_conditions: need at least one row")
    keys = list(rows[0])
    for i, row in enumerate(rows[1:], start=1):
        if set(row) != set(keys):
            raise ValueError(
                f"stack_conditions: row {i} has keys {sorted(row)}, row 0 has {sorted(keys)}"
            )
    out: dict[str, Tensor] = {}
    for k in keys:
        shape = rows[0][k].shape
        for i, row in enumerate(rows):
            if row[k].shape != shape:
                raise ValueError(
                    f"stack_conditions: key {k!r} has shape {tuple(row[k].shape)} in row {i}, "
                    f"{tuple(shape)} in row 0"
                )
        out[k] = torch.stack([row[k] for row in rows])
    return out


@dataclass
class Trajectory:
    """One request's rollout; the same structure from every engine.

    Attributes:
        request_id, prompt, seed: echoed from the request.
        window: ``(start, end)`` SDE steps (end exclusive), ``W = end - start``.
        latents: (W + 1, *latent_shape): x at steps start..end (``latents[k]`` is the input of
            window step k, ``latents[k + 1]`` its output).
        log_probs: (W,) log-density of each window step (``omni_algos.sde.step``).
        sigmas, sigmas_next: (W,) sigma and next sigma of each window step.
        final_latent: x at the end of denoising (None when ``output == "pixel"``).
        media: uint8 channels-last media when ``output`` is "pixel" or "both", else None.
        condition: the row's condition tensors (no batch dim) for the trainer's replay.
        version: the weights version the wave ran on.
        timings: seconds: queue_s, encode_s, denoise_s, decode_s, total_s.
        negative_prompt: echoed from the request.
        params: the request's sampling parameters.
    """

    request_id: str
    prompt: str
    seed: int
    window: tuple[int, int]
    latents: Tensor
    log_probs: Tensor
    sigmas: Tensor
    sigmas_next: Tensor
    final_latent: Tensor | None
    media: Tensor | None
    condition: dict[str, Tensor]
    version: int
    timings: dict[str, float] = field(default_factory=dict)
    negative_prompt: str | None = None
    params: SamplingParams | None = None

    @property
    def window_size(self) -> int:
        return self.window[1] - self.window[0]
