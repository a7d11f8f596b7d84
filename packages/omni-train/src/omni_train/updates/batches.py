"""The batches the update steps train on, built from a rollout by the loop (the driver).

One dataclass per update input: `ReplayBatch` (SDE replay), `SampleBatch` (DiffusionNFT),
`PairBatch` (online Diffusion-DPO), `TokenBatch` (GSPO / GRPO). Rows are the first dimension
of every tensor except the noise draws ``t`` (K, B) and ``eps`` (K, B, ...), whose rows are the
second. `select_rows` takes a rank's rows; `batch_to_wire` / `batch_from_wire` carry a batch to
a Ray worker as safetensors tensors plus JSON (never pickle).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from ..seeds import DOMAIN_FORWARD, derive_seed

__all__ = [
    "PairBatch",
    "ReplayBatch",
    "SampleBatch",
    "TokenBatch",
    "batch_from_wire",
    "batch_to_wire",
    "forward_draws",
    "noise_to",
    "pair_batch",
    "replay_batch",
    "sample_batch",
    "select_rows",
    "token_batch",
]

#: fields whose rows are the second dimension (noise draws: (K, B, ...))
_ROWS_SECOND = ("t", "eps")


@dataclass
class ReplayBatch:
    """SDE window steps to replay: ``latents[:, j]`` is window step j's input and
    ``latents[:, j + 1]`` its stored output, with its log-prob ``log_probs[:, j]``."""

    latents: Tensor  # (B, W + 1, *latent)
    log_probs: Tensor  # (B, W)
    sigmas: Tensor  # (B, W)
    sigmas_next: Tensor  # (B, W)
    noise_levels: Tensor  # (B,): each trajectory's own SDE noise level
    sde_kinds: list[str]  # (B,): each trajectory's own SDE kind
    advantages: Tensor  # (B,)
    condition: dict[str, Tensor]  # (B, ...) per key
    params: Any  # SamplingParams the velocity needs (guidance, size), shared by the batch
    versions: Tensor  # (B,) int64: the weights version each sample was rolled out on


@dataclass
class SampleBatch:
    """Clean samples with advantages and their noise draws (DiffusionNFT)."""

    x0: Tensor  # (B, *latent)
    advantages: Tensor  # (B,)
    condition: dict[str, Tensor]
    params: Any
    t: Tensor  # (K, B)
    eps: Tensor  # (K, B, *latent)


@dataclass
class PairBatch:
    """Preference pairs, winner ``w`` and loser ``l`` of one prompt group sharing ``t`` and
    ``eps`` (online Diffusion-DPO)."""

    x0_w: Tensor  # (P, *latent)
    x0_l: Tensor
    condition_w: dict[str, Tensor]
    condition_l: dict[str, Tensor]
    params: Any
    t: Tensor  # (K, P)
    eps: Tensor  # (K, P, *latent)


@dataclass
class TokenBatch:
    """Sampled responses of a thinker with their rollout log-probs (GSPO / GRPO)."""

    tokens: Tensor  # (B, T) int64, padded
    log_probs: Tensor  # (B, T) float32
    mask: Tensor  # (B, T) bool, False after EOS and in the padding
    advantages: Tensor  # (B,)
    temperature: float
    contents: list[Any]  # (B,): each prompt's chat content (`OmniItem.content()`)
    images: list[np.ndarray | None] = field(default_factory=list)  # (B,): uint8 (H, W, 3)


Batch = TypeVar("Batch", ReplayBatch, SampleBatch, PairBatch, TokenBatch)


def select_rows(batch: Batch, rows: list[int]) -> Batch:
    """The batch restricted to ``rows`` (in that order)."""
    idx = torch.as_tensor(rows, dtype=torch.long)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, Tensor):
            out[f.name] = v[:, idx] if f.name in _ROWS_SECOND else v[idx]
        elif isinstance(v, dict):
            out[f.name] = {k: t[idx] for k, t in v.items()}
        elif isinstance(v, list):
            out[f.name] = [v[i] for i in rows]
        else:
            out[f.name] = v
    return type(batch)(**out)


def batch_to_wire(batch: Any) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``(tensors, meta)``: tensors for safetensors, every other field as JSON text."""
    tensors: dict[str, Tensor] = {}
    meta: dict[str, str] = {"type": type(batch).__name__}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, Tensor):
            tensors[f.name] = v.detach().cpu().contiguous()
        elif isinstance(v, dict):
            for k, t in v.items():
                tensors[f"{f.name}.{k}"] = t.detach().cpu().contiguous()
            meta[f.name] = json.dumps({"dict": sorted(v)})
        elif f.name == "images":
            present = [i for i, im in enumerate(v) if im is not None]
            for i in present:
                tensors[f"images.{i}"] = torch.from_numpy(np.ascontiguousarray(v[i]))
            meta[f.name] = json.dumps({"images": present, "n": len(v)})
        elif hasattr(v, "to_dict"):  # SamplingParams
            meta[f.name] = json.dumps({"params": v.to_dict()})
        else:
            meta[f.name] = json.dumps({"json": v})
    return tensors, meta


def batch_from_wire(tensors: dict[str, Tensor], meta: dict[str, str]) -> Any:
    """Inverse of `batch_to_wire`."""
    from diffusion_rollout import SamplingParams

    cls = {c.__name__: c for c in (ReplayBatch, SampleBatch, PairBatch, TokenBatch)}[meta["type"]]
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in tensors:
            out[f.name] = tensors[f.name]
            continue
        m = json.loads(meta[f.name])
        if "dict" in m:
            out[f.name] = {k: tensors[f"{f.name}.{k}"] for k in m["dict"]}
        elif "images" in m:
            ims: list[np.ndarray | None] = [None] * m["n"]
            for i in m["images"]:
                ims[i] = tensors[f"images.{i}"].numpy()
            out[f.name] = ims
        elif "params" in m:
            out[f.name] = SamplingParams.from_dict(m["params"])
        else:
            out[f.name] = m["json"]
    return cls(**out)


# ---------------------------------------------------------------------------------------------
# built by the loop from a rollout


def _stack(trajs: list[Any], attr: str) -> Tensor:
    return torch.stack([getattr(t, attr) for t in trajs])


def _velocity_params(trajs: list[Any]) -> Any:
    """The sampling params the replayed velocity uses; the batch must share them."""
    first = trajs[0].params
    key = first.compat_key()[:-2]  # size, steps, guidance (not output / weights version)
    for i, t in enumerate(trajs):
        if t.params.compat_key()[:-2] != key:
            raise ValueError(
                f"update batch: trajectory {i} was sampled with other size/guidance settings "
                f"({t.params.compat_key()}) than trajectory 0 ({first.compat_key()})"
            )
    return first


def replay_batch(trajs: list[Any], advantages: Tensor) -> ReplayBatch:
    """The SDE windows of `diffusion_rollout.Trajectory` objects (windows of equal size)."""
    from diffusion_rollout import stack_conditions

    sizes = {t.window_size for t in trajs}
    if len(sizes) != 1:
        raise ValueError(f"update batch: the trajectories' SDE windows differ in size ({sizes})")
    return ReplayBatch(
        latents=_stack(trajs, "latents").float(),
        log_probs=_stack(trajs, "log_probs").float(),
        sigmas=_stack(trajs, "sigmas").float(),
        sigmas_next=_stack(trajs, "sigmas_next").float(),
        noise_levels=torch.tensor([t.params.noise_level for t in trajs], dtype=torch.float32),
        sde_kinds=[t.params.sde_kind for t in trajs],
        advantages=advantages.float(),
        condition=stack_conditions([t.condition for t in trajs]),
        params=_velocity_params(trajs),
        versions=torch.tensor([int(t.version) for t in trajs], dtype=torch.long),
    )


def noise_to(x0: Tensor, t: Tensor, eps: Tensor) -> Tensor:
    """``x_t = (1 - t) x0 + t eps`` with ``t`` of shape (B,) broadcast over the other dims."""
    tt = t.reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - tt) * x0 + tt * eps


def forward_draws(
    seed: int, step: int, k: int, shape: tuple[int, ...], t_range: tuple[float, float]
) -> tuple[Tensor, Tensor]:
    """``k`` draws of ``(t, eps)`` for rows of ``shape`` (B, ...): ``t ~ U[lo, hi]`` (k, B) and
    ``eps ~ N(0, I)`` (k, B, ...), from one generator seeded by (run seed, step), so a resumed
    run draws what an uninterrupted run would."""
    g = torch.Generator().manual_seed(derive_seed(seed, step, 0, DOMAIN_FORWARD))
    lo, hi = t_range
    t = lo + (hi - lo) * torch.rand((k, shape[0]), generator=g)
    eps = torch.randn((k, *shape), generator=g)
    return t, eps


def _final_latents(trajs: list[Any]) -> Tensor:
    if any(t.final_latent is None for t in trajs):
        raise ValueError(
            "update batch: the forward-process losses train on the final latents; the rollout "
            "returned none (SamplingParams.output must be 'latent' or 'both')"
        )
    return _stack(trajs, "final_latent").float()


def sample_batch(trajs: list[Any], advantages: Tensor, draws: tuple[Tensor, Tensor]) -> SampleBatch:
    """The clean samples of a rollout with their advantages and noise draws (NFT)."""
    from diffusion_rollout import stack_conditions

    return SampleBatch(
        x0=_final_latents(trajs),
        advantages=advantages.float(),
        condition=stack_conditions([t.condition for t in trajs]),
        params=_velocity_params(trajs),
        t=draws[0],
        eps=draws[1],
    )


def pair_batch(
    trajs: list[Any], winners: Tensor, losers: Tensor, draws: tuple[Tensor, Tensor]
) -> PairBatch:
    """Winner/loser pairs of a rollout (rows ``winners[p]``, ``losers[p]``) sharing draws."""
    from diffusion_rollout import stack_conditions

    x0 = _final_latents(trajs)
    cond = stack_conditions([t.condition for t in trajs])
    return PairBatch(
        x0_w=x0[winners],
        x0_l=x0[losers],
        condition_w={k: v[winners] for k, v in cond.items()},
        condition_l={k: v[losers] for k, v in cond.items()},
        params=_velocity_params(trajs),
        t=draws[0],
        eps=draws[1],
    )


def token_batch(
    items: list[Any],
    tokens: Tensor,
    log_probs: Tensor,
    mask: Tensor,
    advantages: Tensor,
    temperature: float,
) -> TokenBatch:
    """A thinker rollout of `omni_train.tasks.OmniItem` questions as a token batch."""
    return TokenBatch(
        tokens=tokens,
        log_probs=log_probs.float(),
        mask=mask.bool(),
        advantages=advantages.float(),
        temperature=float(temperature),
        contents=[it.content() for it in items],
        images=[it.image for it in items],
    )
