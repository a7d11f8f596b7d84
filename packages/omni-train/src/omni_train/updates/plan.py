"""Which rows each optimizer step trains on, split over ranks and micro-batches in lockstep.

A rollout batch of ``n`` rows is trained for `algorithm.epochs` passes of
`algorithm.num_minibatches` optimizer steps. Epoch ``e`` walks the rows in the order
``randperm(n)`` seeded by (run seed, step, e) (`seeds.DOMAIN_MINIBATCH`; no shuffle with one
minibatch); minibatch ``k`` is positions ``[k m, (k + 1) m)`` with ``m = max(1, n // K)``.

With ``R`` ranks (FSDP), minibatch rows are split into ``R`` contiguous shares (sizes differ
by at most one), and each share into micro-batches of at most ``rows_per_forward`` rows. FSDP
runs collectives inside every forward and backward, so every rank must run the same number of
forwards: all ranks use the same micro-batch count, and a rank whose share is short pads with
a *dummy* micro-batch (one of its rows, weight 0), which keeps the ranks in step without
changing the gradient. The update scales each micro-batch's mean loss by its share of the
minibatch, so the summed gradient is the minibatch mean whatever the split
(`omni_train.updates.common` has the algebra).

``pack`` items (SDE window steps, or noise draws) go through one forward together, each row
with its own timestep (the velocity takes one sigma per row), as long as
``rows x pack <= rows_per_forward``: fewer, larger forwards, the same gradient. The split is
chosen by that memory cap: of all micro-batch counts ``c`` (``r = ceil(share / c)`` rows each,
``pack = min(items, rows_per_forward // r)``), the one with the fewest forwards
``c x ceil(items / pack)``, the fewest micro-batches on a tie. E.g. 10 rows, 7 window steps and
``rows_per_forward`` 16 run as 5 micro-batches of 2 rows x 7 steps (5 forwards of 14 rows)
instead of 7 forwards of 10 rows, one step each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..seeds import DOMAIN_MINIBATCH, derive_seed

__all__ = ["OptimizerStepPlan", "UpdatePlan", "make_update_plans", "minibatch_orders"]


@dataclass
class OptimizerStepPlan:
    """One optimizer step on one rank: its micro-batches (positions into `UpdatePlan.rows`).

    ``dummy[i]`` marks a micro-batch that only keeps the ranks in step (weight 0)."""

    epoch: int
    minibatch: int
    chunks: list[list[int]]
    dummy: list[bool]
    pack: int


@dataclass
class UpdatePlan:
    """One rank's work: the global batch ``rows`` it holds (sorted), its optimizer steps, and
    the micro-batches of the no-grad passes over all its rows (`prepass`, same count on every
    rank)."""

    rows: list[int]
    steps: list[OptimizerStepPlan]
    prepass: list[list[int]]
    prepass_pack: int

    def to_json(self) -> dict:
        return {
            "rows": self.rows,
            "steps": [[s.epoch, s.minibatch, s.chunks, s.dummy, s.pack] for s in self.steps],
            "prepass": self.prepass,
            "prepass_pack": self.prepass_pack,
        }

    @classmethod
    def from_json(cls, d: dict) -> UpdatePlan:
        steps = [OptimizerStepPlan(e, k, c, dm, p) for e, k, c, dm, p in d["steps"]]
        return cls(list(d["rows"]), steps, d["prepass"], int(d["prepass_pack"]))


def minibatch_orders(
    n: int, num_minibatches: int, epochs: int, seed: int, step: int
) -> list[list[list[int]]]:
    """``orders[e][k]``: the global rows of minibatch ``k`` of epoch ``e`` (module docstring)."""
    size = max(1, n // num_minibatches)
    count = min(num_minibatches, n)
    out = []
    for e in range(epochs):
        if num_minibatches > 1:
            g = torch.Generator().manual_seed(derive_seed(seed, step, e, DOMAIN_MINIBATCH))
            perm = torch.randperm(n, generator=g).tolist()
        else:
            perm = list(range(n))
        out.append([perm[k * size : (k + 1) * size] for k in range(count)])
    return out


def _split(items: list[int], parts: int) -> list[list[int]]:
    """Contiguous parts, sizes differing by at most one (some may be empty)."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(items[start : start + size])
        start += size
    return out


def _pack(cap: int | None, rows: int, items: int) -> int:
    if cap is None or rows <= 0:
        return 1
    return max(1, min(items, cap // rows))


def _split_for_cap(rows: int, cap: int | None, items: int) -> tuple[int, int]:
    """``(micro-batches, pack)`` for a share of ``rows`` rows with ``items`` items each: the
    fewest forwards with at most ``cap`` rows x items per forward (module docstring)."""
    if cap is None or rows <= 0:
        return 1, 1
    best: tuple[int, int, int] | None = None  # (forwards, micro-batches, pack)
    for n in range(max(1, math.ceil(rows / cap)), rows + 1):
        pack = _pack(cap, math.ceil(rows / n), items)
        forwards = n * math.ceil(items / pack)
        if best is None or forwards < best[0]:
            best = (forwards, n, pack)
        if pack == items:  # more micro-batches cannot pack more
            break
    assert best is not None
    return best[1], best[2]


def make_update_plans(
    n: int,
    *,
    num_minibatches: int,
    epochs: int,
    seed: int,
    step: int,
    world_size: int = 1,
    rows_per_forward: int | None = None,
    items: int = 1,
) -> list[UpdatePlan]:
    """Each rank's `UpdatePlan` for a batch of ``n`` rows (module docstring).

    ``rows_per_forward`` caps the rows of one forward (None: a rank's whole minibatch share
    in one forward, one item at a time); ``items`` is how many window steps / noise draws
    each row has (what ``pack`` groups)."""
    if n < 1:
        raise ValueError("make_update_plans: the batch is empty")
    orders = minibatch_orders(n, num_minibatches, epochs, seed, step)
    shares = [[_split(mb, world_size) for mb in epoch] for epoch in orders]
    held: list[set[int]] = [set() for _ in range(world_size)]
    for epoch in shares:
        for mb in epoch:
            for r, part in enumerate(mb):
                held[r].update(part)
    for r in range(world_size):
        if not held[r]:  # more ranks than rows: hold row 0 for the dummy passes
            held[r].add(orders[0][0][0])
    rows = [sorted(h) for h in held]
    pos = [{g: i for i, g in enumerate(rr)} for rr in rows]

    steps: list[list[OptimizerStepPlan]] = [[] for _ in range(world_size)]
    for e, epoch in enumerate(shares):
        for k, mb in enumerate(epoch):
            biggest = max(len(part) for part in mb)
            n_chunks, pack = _split_for_cap(biggest, rows_per_forward, items)
            for r, part in enumerate(mb):
                chunks, dummy = [], []
                for c in _split(part, n_chunks):
                    if c:
                        chunks.append([pos[r][g] for g in c])
                        dummy.append(False)
                    else:  # keep this rank's forward count equal to the others'
                        chunks.append([0])
                        dummy.append(True)
                steps[r].append(OptimizerStepPlan(e, k, chunks, dummy, pack))

    n_pre, pre_pack = _split_for_cap(max(len(rr) for rr in rows), rows_per_forward, items)
    plans = []
    for r in range(world_size):
        pre = [c if c else [0] for c in _split(list(range(len(rows[r]))), n_pre)]
        plans.append(UpdatePlan(rows[r], steps[r], pre, pre_pack))
    return plans
