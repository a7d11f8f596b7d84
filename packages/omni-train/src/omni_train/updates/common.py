"""What every update step shares: the collective, the settings, the optimizer step, metrics.

The gradient algebra (why one implementation serves one process and FSDP ranks alike). An
optimizer step trains on a minibatch of ``U`` loss units (rows; tokens for token-mean
losses), split over ``R`` ranks and, on each rank, over micro-batches ``c`` of ``u_c`` units.
The loss of a micro-batch is the mean over its units, ``L_c``. Each rank back-propagates

    L_c * (u_c / U) * S,        S = `Collective.grad_scale`,

and the gradient reduction sums (one process, ``S = 1``) or averages over ranks (FSDP2's
reduce-scatter, ``S = R``), so the gradient is

    (S / R_avg) sum_c (u_c / U) grad L_c = (1 / U) sum_i grad l_i,

the gradient of the minibatch mean, for any split. ``U`` is summed over ranks with
`Collective.all_sum` before the first backward. Metrics are reduced with the same weights,
so they are the minibatch's whatever the split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..algorithms import Algorithm
from ..errors import NonFiniteError
from .plan import OptimizerStepPlan, UpdatePlan

__all__ = [
    "KL_METRIC_ROWS",
    "Collective",
    "LocalCollective",
    "MeanMetrics",
    "UpdateContext",
    "UpdateSettings",
    "item_groups",
    "kl_metric_rows",
    "minibatch_spreads",
    "optimizer_step",
    "run_optimizer_steps",
]


class Collective(Protocol):
    """How the ranks of one update agree on numbers (see the module docstring)."""

    #: factor on each backward so that the gradient reduction yields the sum (1, or R)
    grad_scale: float

    def all_sum(self, values: Sequence[float]) -> list[float]: ...

    def all_max(self, values: Sequence[float]) -> list[float]: ...

    def full_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A sharded tensor (DTensor) gathered whole; a plain tensor as is."""
        ...


class LocalCollective:
    """One process: nothing to agree with."""

    grad_scale = 1.0

    def all_sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def all_max(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def full_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t


@dataclass(frozen=True)
class UpdateSettings:
    """The recipe's knobs an update reads (plain values, so Ray workers get them as JSON)."""

    clip_range: float | None = None  # None: the loss's own default
    adv_clip_max: float = 5.0
    kl_beta: float = 0.0
    grad_clip: float = 1.0
    ema_decay: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)
    #: token kind: constrained-decoding token ids the replay masks to (None: off)
    allowed_tokens: tuple[int, ...] | None = None
    #: after the update, measure the policy's KL to the reference (the LoRA-off model) on a
    #: micro-batch: `policy/kl_to_ref` (when the loss has no KL term of its own to log)
    measure_kl_ref: bool = False
    #: forward-process losses: "uniform" t as drawn, or "schedule" (`forward_process.training_t`)
    timestep_sampling: str = "uniform"
    timestep_range: tuple[float, float] = (0.0, 1.0)

    @classmethod
    def from_recipe(
        cls, recipe: Any, allowed_tokens: Sequence[int] | None = None
    ) -> UpdateSettings:
        a, o = recipe.algorithm, recipe.optimizer
        return cls(
            clip_range=a.clip_range,
            adv_clip_max=a.adv_clip_max,
            kl_beta=a.kl_beta,
            grad_clip=o.grad_clip,
            ema_decay=o.ema_decay,
            options=dict(a.options),
            allowed_tokens=None if allowed_tokens is None else tuple(allowed_tokens),
            measure_kl_ref=recipe.lora.enabled and a.kl_beta == 0,
            timestep_sampling=a.timestep_sampling,
            timestep_range=tuple(a.timestep_range),
        )


@dataclass
class UpdateContext:
    """What an update trains: the adapter (its trainable parameters), the optimizer, the
    algorithm's table row, the settings, and the collective of this rank."""

    adapter: Any
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    algorithm: Algorithm
    settings: UpdateSettings
    collective: Collective = field(default_factory=LocalCollective)


#: `omni_algos.losses`' spread metrics: ``X_std`` comes with ``X_mean`` and this
DEV_SQ_SUFFIX = "_dev_sq_mean"


def minibatch_spreads(means: dict[str, float]) -> dict[str, float]:
    """``means`` (metrics already reduced over a minibatch: every micro-batch, window step and
    rank) with each ``X_std`` the minibatch's population std of ratio ``X``,
    ``sqrt(X_dev_sq_mean - (X_mean - 1)^2)``, and the ``X_dev_sq_mean`` keys dropped.

    A loss reports the std of the piece it saw (a micro-batch, one window step, one rank's
    rows); a mean of those is not the minibatch's std and changes with the split (one-row
    micro-batches read 0). The element means it also reports do add up to the minibatch's."""
    out = {k: v for k, v in means.items() if not k.endswith(DEV_SQ_SUFFIX)}
    for k, v in means.items():
        name = k.removesuffix(DEV_SQ_SUFFIX)
        if name != k and f"{name}_mean" in means:
            var = v - (means[f"{name}_mean"] - 1.0) ** 2
            out[f"{name}_std"] = math.sqrt(max(var, 0.0))
    return out


class MeanMetrics:
    """Running means of named floats (each optimizer step adds one value per name)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.counts[key] = self.counts.get(key, 0) + 1

    def add_reduced(self, collective: Collective, weighted: dict[str, float]) -> None:
        """Sum `weighted` (this rank's share-weighted values) over ranks and add each, with
        each spread recomputed from the sums (`minibatch_spreads`)."""
        keys = sorted(weighted)
        summed = dict(zip(keys, collective.all_sum([weighted[k] for k in keys]), strict=True))
        for k, v in minibatch_spreads(summed).items():
            self.add(k, v)

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}


def optimizer_step(ctx: UpdateContext, bad_loss: float, where: str, metrics: MeanMetrics) -> None:
    """Finish an optimizer step: agree on non-finite losses, clip the global gradient norm,
    step, update the EMA. Every rank raises the same `NonFiniteError`, never only one (the
    others would wait in a collective forever)."""
    (bad,) = ctx.collective.all_max([bad_loss])
    if bad > 0:
        raise NonFiniteError(f"loss is not finite ({where})")
    norm = torch.nn.utils.clip_grad_norm_(ctx.params, ctx.settings.grad_clip)
    norm = float(ctx.collective.full_tensor(norm))
    if not torch.isfinite(torch.tensor(norm)):
        raise NonFiniteError(f"gradient norm is {norm} ({where})")
    ctx.optimizer.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    if ctx.settings.ema_decay > 0:
        ctx.adapter.ema_adapter("default", "ema", ctx.settings.ema_decay)
    metrics.add("actor/grad_norm", norm)


def item_groups(items: int, pack: int) -> list[list[int]]:
    """``range(items)`` in groups of ``pack`` (the items that share one forward)."""
    return [list(range(s, min(s + pack, items))) for s in range(0, items, pack)]


#: rows `policy/kl_to_ref` is measured on after each update. A monitoring metric: on the
#: whole first micro-batch its two no-grad passes cost as many transformer rows as the
#: update's own forwards (docs/performance.md), so a few rows spread over it instead
KL_METRIC_ROWS = 4


def kl_metric_rows(rows: list[int]) -> list[int]:
    """At most `KL_METRIC_ROWS` of ``rows``, evenly spread (so not all one prompt's samples)."""
    stride = max(1, len(rows) // KL_METRIC_ROWS)
    return rows[::stride][:KL_METRIC_ROWS]


#: ``micro_loss(rows, items, step_index, dummy) -> (loss, metrics)``: the loss of a
#: micro-batch's rows over a group of its items (window steps, noise draws), already divided
#: by the number of items per row, and its metrics likewise divided
MicroLoss = Callable[[list[int], list[int], int, bool], tuple[torch.Tensor, dict[str, float]]]


def run_optimizer_steps(
    ctx: UpdateContext,
    plan: UpdatePlan,
    *,
    items: int,
    micro_loss: MicroLoss,
    units: Callable[[list[int]], float] = len,
    on_step: Callable[[OptimizerStepPlan, list[int]], None] | None = None,
) -> MeanMetrics:
    """The optimizer steps of one rank's ``plan``, the same for every update kind.

    For each step: the minibatch's loss units ``U`` summed over ranks; then, per micro-batch
    and group of items, ``micro_loss`` and one backward of ``loss * (u_c / U) * grad_scale``
    (module docstring); then `optimizer_step`. ``units(rows)`` counts a micro-batch's loss
    units (rows by default); ``on_step(step, real_rows)`` runs before a step's first
    micro-batch (collectives allowed: every rank calls it). Returns the metrics: per step
    ``loss``, ``actor/*`` and ``actor/grad_norm``, as minibatch values."""
    col = ctx.collective
    metrics = MeanMetrics()
    for n_step, st in enumerate(plan.steps):
        real_rows = [r for c, d in zip(st.chunks, st.dummy) if not d for r in c]
        (total,) = col.all_sum([sum(units(c) for c, d in zip(st.chunks, st.dummy) if not d)])
        if on_step is not None:
            on_step(st, real_rows)
        weighted: dict[str, float] = {}
        bad = 0.0
        where = f"epoch {st.epoch}, minibatch {st.minibatch}"
        for rows, dummy in zip(st.chunks, st.dummy):
            share = 0.0 if dummy or total <= 0 else units(rows) / total
            for group in item_groups(items, st.pack):
                loss, m = micro_loss(rows, group, n_step, dummy)
                if not dummy and not bool(torch.isfinite(loss.detach())):
                    bad = 1.0
                (loss * (share * col.grad_scale)).backward()
                weighted["loss"] = weighted.get("loss", 0.0) + float(loss.detach()) * share
                for k, v in m.items():
                    key = f"actor/{k}"
                    weighted[key] = weighted.get(key, 0.0) + float(v) * share
        optimizer_step(ctx, bad, where, metrics)
        metrics.add_reduced(col, weighted)
    return metrics
