"""The memory `algorithm.reuse_rollout_forward` holds, checked before it piles up.

With the key on, the rollout keeps the autograd graph of every trained step of the whole
batch until the update's one backward. That is

    needed = A N W

bytes, with ``A`` one sample's activations in a training forward (all its guidance branches:
`auto_rows.RowsBudget.bytes_per_row`, read from the first transformer block's inputs), ``N``
the samples of a step (`data.prompts_per_step` x `rollout.n`) and ``W`` the trained steps of
each (`rollout.sde_window_size`). At the rollout's first forward with autograd (before its
first block has run: nothing of the graph is held yet) ``needed`` is compared with the
activation budget of `auto_rows.memory_budget_bytes` (a share of the free memory); above it
the run stops with a `TrainError` naming the key, instead of running the machine out of
memory halfway through a rollout. The check runs once per process (the first step of a run,
or of a resumed one).

When ``needed`` exceeds the budget, every later forward with autograd on the watched model
raises the same `ReuseDoesNotFit` until ``close()``: each wave of that rollout stops at its
first trained step, so no wave's graph piles up after the first. With `true` the run stops
there; with `auto` the loop (`omni_train.loops.schedule.SyncRollout`) closes the check and
rolls the step out again without autograd, and the update replays the trained steps, for
the rest of the run.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import TrainError
from .auto_rows import RowsBudget, free_memory_bytes, guidance_branches, memory_budget_bytes

__all__ = ["ReuseDoesNotFit", "ReuseMemoryCheck", "reuse_memory_check"]


class ReuseDoesNotFit(TrainError):
    """The rollout's graph of a whole batch would exceed the activation budget; ``check``
    is the `ReuseMemoryCheck` that refuses it (``check.close()`` stops the refusing)."""

    def __init__(self, message: str, check: ReuseMemoryCheck) -> None:
        super().__init__(message)
        self.check = check


class ReuseMemoryCheck:
    """Watches ``adapter``'s first transformer block; at its first forward with autograd,
    raises `ReuseDoesNotFit` (a `TrainError`) when ``samples`` x ``steps`` samples'
    activations exceed the budget, and again at every later one until closed (module
    docstring). ``close()`` removes the hooks (also done after a check that passes)."""

    def __init__(
        self,
        adapter: Any,
        *,
        samples: int,
        steps: int,
        gradient_checkpointing: bool = False,
        branches: int = 1,
    ) -> None:
        # the watch's hook records the block's inputs; this one, registered after it, reads them
        self.watch = RowsBudget(
            adapter, gradient_checkpointing=gradient_checkpointing, branches=branches
        )
        self.samples, self.steps = samples, steps
        self.needed_bytes: float | None = None  # set by the check
        self.refusal: str | None = None  # the error's message once the batch did not fit
        block = adapter.fsdp_wrap_modules()[0]
        self._handle = block.register_forward_pre_hook(self._check, with_kwargs=True)

    def _check(self, _module: Any, _args: tuple, _kwargs: dict) -> None:
        if self.refusal is not None:
            if torch.is_grad_enabled():
                raise ReuseDoesNotFit(self.refusal, self)
            return
        per_sample = self.watch.bytes_per_row()
        if per_sample is None:  # a no-grad forward: nothing is kept
            return
        self.needed_bytes = per_sample * self.samples * self.steps
        device = self.watch.device
        free = free_memory_bytes(device)
        budget = memory_budget_bytes(device, free)
        if self.needed_bytes <= budget:
            self.close()
        else:
            from omni_adapters.memory import GIB  # as auto_rows: imported where it is used

            self.refusal = (
                f"algorithm.reuse_rollout_forward: the rollout would keep the activations of "
                f"{self.samples} samples x {self.steps} trained steps until the update, about "
                f"{self.needed_bytes / GIB:.2f} GiB ({per_sample / 2**20:.2f} MiB a sample and "
                f"step), more than the {budget / GIB:.2f} GiB the activations may take of the "
                f"{free / GIB:.2f} GiB free on {device}. Turn it off (the update then replays "
                f"the steps in micro-batches of algorithm.rows_per_forward), or lower "
                f"data.prompts_per_step, rollout.n or rollout.sde_window_size"
            )
            raise ReuseDoesNotFit(self.refusal, self)

    def close(self) -> None:
        self._handle.remove()
        self.watch.close()


def reuse_memory_check(recipe: Any, adapter: Any) -> ReuseMemoryCheck | None:
    """A `ReuseMemoryCheck` on ``adapter`` when the update back-propagates through the
    rollout (`Recipe.reuses_rollout_forward`)."""
    if not recipe.reuses_rollout_forward():
        return None
    return ReuseMemoryCheck(
        adapter,
        samples=recipe.data.prompts_per_step * recipe.rollout.n,
        steps=recipe.rollout.sde_window_size,
        gradient_checkpointing=bool(recipe.model.options.get("gradient_checkpointing", False)),
        branches=guidance_branches(recipe),
    )
