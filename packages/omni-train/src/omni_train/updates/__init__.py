"""One update step per algorithm kind, used by every backend (`omni_train.algorithms`).

`run_update(ctx, batch, plan)` trains one rank's share of a rollout batch: in one process
the rank is the whole batch (`LocalCollective`); on Ray each FSDP actor runs the same
function on its rows with a collective that all-reduces (`omni_train.backends.fsdp`).
"""

from __future__ import annotations

from typing import Any

from .auto_rows import RowsBudget, rows_budget
from .batches import (
    PairBatch,
    ReplayBatch,
    SampleBatch,
    TokenBatch,
    batch_from_wire,
    batch_to_wire,
    forward_draws,
    noise_to,
    pair_batch,
    replay_batch,
    sample_batch,
    select_rows,
    token_batch,
)
from .common import (
    Collective,
    LocalCollective,
    MeanMetrics,
    UpdateContext,
    UpdateSettings,
    run_optimizer_steps,
)
from .forward_process import diffusion_dpo_update, diffusion_nft_update
from .plan import OptimizerStepPlan, UpdatePlan, make_update_plans, minibatch_orders
from .replay import replay_steps, sde_replay_update
from .reuse_memory import ReuseMemoryCheck, reuse_memory_check
from .token import token_update

__all__ = [
    "Collective",
    "LocalCollective",
    "MeanMetrics",
    "OptimizerStepPlan",
    "PairBatch",
    "ReplayBatch",
    "ReuseMemoryCheck",
    "RowsBudget",
    "SampleBatch",
    "TokenBatch",
    "UpdateContext",
    "UpdatePlan",
    "UpdateSettings",
    "batch_from_wire",
    "batch_rows",
    "batch_to_wire",
    "diffusion_dpo_update",
    "diffusion_nft_update",
    "forward_draws",
    "make_update_plans",
    "minibatch_orders",
    "noise_to",
    "pair_batch",
    "replay_batch",
    "replay_steps",
    "reuse_memory_check",
    "rows_budget",
    "run_optimizer_steps",
    "run_update",
    "sample_batch",
    "sde_replay_update",
    "select_rows",
    "token_batch",
    "token_update",
    "update_plans",
]


def run_update(
    ctx: UpdateContext, batch: Any, plan: UpdatePlan, *, correction: str | None = None
) -> dict[str, float]:
    """The update of ``ctx.algorithm``'s kind on one rank's share (``batch`` = ``plan.rows``)."""
    kind = ctx.algorithm.kind
    if kind == "sde_replay":
        return sde_replay_update(ctx, batch, plan, correction=correction)
    if correction is not None:
        raise ValueError(f"correction: {ctx.algorithm.name} takes no per-sample weights")
    if kind == "forward_process":
        if ctx.algorithm.pairs:
            return diffusion_dpo_update(ctx, batch, plan)
        return diffusion_nft_update(ctx, batch, plan)
    return token_update(ctx, batch, plan)


def batch_rows(batch: Any) -> int:
    """Rows of a batch (samples; pairs for a `PairBatch`)."""
    return int((batch.x0_w if isinstance(batch, PairBatch) else batch.advantages).shape[0])


def update_plans(
    recipe: Any, batch: Any, step: int, world_size: int, rows_fit: int | None = None
) -> list[UpdatePlan]:
    """Each rank's plan for ``batch`` under the recipe's `algorithm.num_minibatches`,
    `epochs`, `rows_per_forward` and `trainer.seed`. ``rows_per_forward`` null means
    `rollout.max_num_seqs`; ``auto`` means ``rows_fit`` (`auto_rows.RowsBudget.rows_fit`,
    the learner's measure), or `rollout.max_num_seqs` while nothing is measured."""
    a = recipe.algorithm
    per_forward = a.rows_per_forward
    if per_forward == "auto":
        per_forward = rows_fit
    per_forward = per_forward or recipe.rollout.max_num_seqs
    if isinstance(batch, ReplayBatch):
        items = int(batch.log_probs.shape[1])
    elif isinstance(batch, (SampleBatch, PairBatch)):
        items = int(batch.t.shape[0])
    else:
        items = 1

    def plans(rows_per_forward: int) -> list[UpdatePlan]:
        return make_update_plans(
            batch_rows(batch),
            num_minibatches=a.num_minibatches,
            epochs=a.epochs,
            seed=recipe.trainer.seed,
            step=step,
            world_size=world_size,
            rows_per_forward=rows_per_forward,
            items=items,
        )

    out = plans(per_forward)
    if isinstance(batch, ReplayBatch) and batch.log_probs.requires_grad:
        # reuse_rollout_forward: the optimizer step is one micro-batch of every row and step,
        # so the loss back-propagates once through each of the rollout's forwards (a split
        # would walk a forward once per part); the no-grad passes keep their split
        whole = plans(batch_rows(batch) * items)
        for plan, one in zip(out, whole):
            plan.steps = one.steps
    return out
