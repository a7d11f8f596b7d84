"""`algorithm.rows_per_forward: auto`: the update's rows per forward chosen by memory.

A training forward keeps activations for its backward in proportion to its rows. Per row

    A = activation_bytes(1, sum_i S_i H_i, L, element_bytes=b)      (omni_adapters.memory)

where ``sum_i S_i H_i`` is the tokens x width entering a transformer block (each (B, S, H)
tensor the block takes: both streams of an MMDiT block, the hidden states of a decoder layer),
``L`` the blocks (`OmniModelBase.fsdp_wrap_modules`) and ``b`` the bytes per number of those
tensors. ``sum_i S_i H_i`` and ``b`` are read from the first block's inputs by a forward
pre-hook, so the count is the model's own, whatever its family; with gradient checkpointing
on, the checkpointed formula applies.

The budget is a share of the memory free when the first update has run (its optimizer state
and its largest forward already allocated once): on CUDA ``CUDA_SHARE`` of
``torch.cuda.mem_get_info`` free bytes plus the bytes torch has reserved but not allocated;
on the CPU ``CPU_SHARE`` of the kernel's ``MemAvailable``, but at most ``CPU_FORWARD_BYTES``:
past half a GiB or so of activations a larger forward stops paying on a CPU (docs/performance.md:
on 2 cores the 8-block width-256 model's update took 4.17 / 3.87 / 4.59 s at 48 / 112 / 336
rows per forward, 4.8 MiB a row). Then

    rows_per_forward = 2^floor(log2(max(1, floor(budget / (A g)))))

and on the CPU at most ``CPU_FORWARD_ROWS``: past about a hundred rows a forward's activation
tensors outgrow glibc's largest heap block (32 MiB), so every one of them is fresh pages
from the kernel on every forward (a 336-row forward + backward of the 4-block width-128 model
took 54,000 page faults and 0.71 s, 0 faults and 0.66 s at 112 rows; docs/performance.md).

with ``g`` = 2 forward rows per sample under classifier-free guidance (both branches), else 1
(a plan's row is a sample), and `omni_train.updates.plan` packs as many window steps (or
noise draws) per forward as that allows: for the small models that train on a CPU a
minibatch usually becomes one forward (docs/performance.md measured fewer, larger forwards
faster there). The first update runs at ``rollout.max_num_seqs`` rows per forward (nothing
measured yet); the gradient does not depend on the split beyond the order of float additions
(1e-5, `test_packed_replay.py`), only speed and memory do. Rounding down to a power of two keeps the
split steady while the free memory moves a little, but a run with ``auto`` is not bit-for-bit
repeatable (a resumed run starts at ``rollout.max_num_seqs`` again), as ``trainer.threads:
auto`` is not.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CPU_FORWARD_BYTES",
    "CPU_FORWARD_ROWS",
    "CPU_SHARE",
    "CUDA_SHARE",
    "RowsBudget",
    "free_memory_bytes",
    "guidance_branches",
    "memory_budget_bytes",
    "rows_budget",
    "rows_within",
]

#: share of the free memory the update's activations may take: on CUDA the estimate is not
#: verified on a GPU yet (docs/performance.md), so it keeps a wide margin
CUDA_SHARE = 0.6
CPU_SHARE = 0.5
#: the most activation bytes one forward takes on a CPU (module docstring)
CPU_FORWARD_BYTES = 2**30
#: the most rows one forward takes on a CPU (module docstring)
CPU_FORWARD_ROWS = 128


def free_memory_bytes(device: torch.device) -> float:
    """Bytes free for new tensors on ``device`` (module docstring)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return float(free + cached)
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024  # the kernel reports kB
    try:  # other POSIX systems
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        raise RuntimeError(
            "algorithm.rows_per_forward: auto cannot read the free memory on this system; "
            "give a number of rows instead"
        ) from None


def _token_width(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(sum of S x H over the (B, S, H) tensors a block takes, bytes per number)."""
    width, element = 0, 0
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.ndim == 3 and v.is_floating_point():
            width += int(v.shape[1]) * int(v.shape[2])
            element = max(element, v.element_size())
    return width, element


class RowsBudget:
    """Watches the first transformer block of ``adapter`` and turns what it sees into the
    rows per forward that fit the budget (module docstring).

    ``rows_fit()`` is None until a training forward has run; ``close()`` removes the hook."""

    def __init__(
        self, adapter: Any, *, gradient_checkpointing: bool = False, branches: int = 1
    ) -> None:
        blocks = adapter.fsdp_wrap_modules()
        if not blocks:
            raise ValueError(
                f"algorithm.rows_per_forward: auto needs the model's transformer blocks; "
                f"{type(adapter).__name__} names none (no_split_modules)"
            )
        self.layers = len(blocks)
        self.device = adapter.device
        self.checkpointing = gradient_checkpointing
        self.branches = branches  # forward rows per sample: 2 with classifier-free guidance
        self.token_width = 0
        self.element_bytes = 0
        self._handle = blocks[0].register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, _module: Any, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():  # no-grad passes keep no activations
            return
        width, element = _token_width(args, kwargs)
        self.token_width = max(self.token_width, width)
        self.element_bytes = max(self.element_bytes, element)

    def bytes_per_row(self) -> float | None:
        """Activation bytes of one sample (all its guidance branches) of a training forward,
        or None before one ran."""
        from omni_adapters.memory import activation_bytes

        if not self.token_width:
            return None
        return activation_bytes(
            self.branches,
            self.token_width,
            self.layers,
            element_bytes=self.element_bytes,
            gradient_checkpointing=self.checkpointing,
        )

    def rows_fit(self, free_bytes: float | None = None) -> int | None:
        """The rows per forward whose activations fit the budget now (``free_bytes``: the
        free memory, measured when None), at least 1; None before a training forward ran."""
        per_row = self.bytes_per_row()
        if per_row is None:
            return None
        if free_bytes is None:
            free_bytes = free_memory_bytes(self.device)
        budget = memory_budget_bytes(self.device, free_bytes)
        if self.device.type == "cuda":
            return rows_within(budget, per_row)
        return min(rows_within(min(budget, CPU_FORWARD_BYTES), per_row), CPU_FORWARD_ROWS)

    def close(self) -> None:
        self._handle.remove()


def memory_budget_bytes(device: torch.device, free_bytes: float) -> float:
    """The share of ``free_bytes`` activations may take on ``device`` (module docstring)."""
    return (CUDA_SHARE if device.type == "cuda" else CPU_SHARE) * free_bytes


def rows_within(budget_bytes: float, bytes_per_row: float) -> int:
    """The largest power of two of rows whose activations fit ``budget_bytes``, at least 1
    (a power of two: small swings of the free memory keep the plan)."""
    rows = max(1, math.floor(max(budget_bytes, 0.0) / bytes_per_row))
    return 1 << (rows.bit_length() - 1)


def guidance_branches(recipe: Any) -> int:
    """Forward rows per sample: 2 when a diffusion recipe's classifier-free guidance packs
    the unconditional branch beside the conditional one, else 1."""
    r = recipe.rollout
    guided = max(r.guidance_scale, r.true_cfg_scale) > 1.0 and not recipe.is_omni()
    return 2 if guided else 1


def rows_budget(recipe: Any, adapter: Any) -> RowsBudget | None:
    """A `RowsBudget` on ``adapter`` when the recipe asks for ``rows_per_forward: auto``."""
    if recipe.algorithm.rows_per_forward != "auto":
        return None
    checkpointing = bool(recipe.model.options.get("gradient_checkpointing", False))
    return RowsBudget(
        adapter, gradient_checkpointing=checkpointing, branches=guidance_branches(recipe)
    )
