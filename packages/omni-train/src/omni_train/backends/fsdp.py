"""FSDP2 sharding and the data-parallel update that matches the local full-batch update.

Each actor worker holds one rank of a ``torch.distributed`` process group (gloo on CPU, NCCL
on GPU). The adapter's FSDP wrap units (``OmniModelBase.fsdp_wrap_modules()``) each become one
``fully_shard`` unit, then the root model; LoRA and frozen base weights shard alike.

Exact equivalence with :meth:`omni_train.trainer.LocalTrainer.update`. A minibatch of ``M``
rows is split over ``R`` ranks into ``n_r`` rows each (``sum_r n_r = M``); the local loss is
the mean over the rank's rows, ``L_r = (1 / n_r) sum_{i in r} l_i``. FSDP2's reduce-scatter
*averages* gradients over ranks, so each rank back-propagates ``L_r * n_r * R / M``:

    (1 / R) sum_r (n_r R / M) grad L_r = (1 / M) sum_i grad l_i = grad of the full-batch mean,

for any split (equal or not). The global gradient-norm clip runs on the sharded gradients
(``clip_grad_norm_`` reduces the norm over DTensor shards), and AdamW steps each shard, so the
updated weights equal the local ones up to float summation order. Loss metrics are reduced
with the same weights ``n_r / M``, so they equal the local full-batch values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import NonFiniteError, TrainError

__all__ = [
    "ShardPlan",
    "full_tensors",
    "gather_rollout_weights",
    "gather_state_dict",
    "init_process_group",
    "make_shard_plan",
    "shard_adapter",
    "sharded_update",
]


def init_process_group(rank: int, world_size: int, addr: str, port: int, backend: str) -> None:
    """Join the trainer's process group (``backend``: ``gloo`` on CPU, ``nccl`` on GPU)."""
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size)


def shard_adapter(adapter: Any, *, mixed_precision: bool = False) -> int:
    """``fully_shard`` each FSDP wrap unit of the trainable model, then the root.

    ``mixed_precision=True`` applies the adapter's ``fsdp_mixed_precision()`` policy (bf16
    compute, fp32 reduce); on CPU the parity checks use the model's own dtype. Returns the
    number of wrap units sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dev = "cuda" if adapter.device.type == "cuda" else "cpu"
    mesh = init_device_mesh(dev, (dist.get_world_size(),))
    kw: dict[str, Any] = {"mesh": mesh}
    if mixed_precision:
        kw["mp_policy"] = adapter.fsdp_mixed_precision()
    units = adapter.fsdp_wrap_modules()
    for m in units:
        fully_shard(m, **kw)
    fully_shard(adapter.model, **kw)
    return len(units)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """All-gather every DTensor (a collective: every rank calls it with the same names)."""
    return {k: _full(tensors[k]).detach().to("cpu").contiguous() for k in sorted(tensors)}


def gather_rollout_weights(adapter: Any, fmt: str = "omni") -> dict[str, torch.Tensor]:
    """The adapter's ``export_rollout_weights(fmt)`` with the shards gathered (LoRA fast path:
    only the LoRA tensors; in full fine-tuning every trainable parameter)."""
    return full_tensors(adapter.export_rollout_weights(fmt))


def gather_state_dict(adapter: Any) -> dict[str, torch.Tensor]:
    """Every weight of the trainable model, gathered (the "full weights" sync)."""
    sd = adapter.model.state_dict()
    return {k: v.float() for k, v in full_tensors(sd).items()}


@dataclass
class ShardPlan:
    """What one rank trains on: ``rows`` (global batch indices it needs, sorted) and, per
    (epoch, minibatch), the positions into ``rows`` of its share of that minibatch."""

    rows: list[int]
    steps: list[tuple[int, int, list[int]]]
    minibatch_size: int


def make_shard_plan(
    perms: list[torch.Tensor], num_minibatches: int, world_size: int
) -> list[ShardPlan]:
    """Split each minibatch of each epoch's permutation into ``world_size`` contiguous chunks
    (sizes differ by at most one). ``perms[e]`` is epoch e's row order, as in the local update."""
    B = int(perms[0].numel())
    mb = B // num_minibatches
    if mb < world_size:
        raise TrainError(
            f"trainer.num_workers: {world_size} actor workers but a minibatch has only {mb} "
            f"rows (data.prompts_per_step * rollout.n / algorithm.num_minibatches)"
        )
    per_rank: list[list[tuple[int, int, list[int]]]] = [[] for _ in range(world_size)]
    for e, perm in enumerate(perms):
        for k in range(num_minibatches):
            idx = perm[k * mb : (k + 1) * mb].tolist()
            for r, chunk in enumerate(torch.tensor(idx).tensor_split(world_size)):
                per_rank[r].append((e, k, chunk.tolist()))
    plans = []
    for steps in per_rank:
        rows = sorted({i for _, _, ids in steps for i in ids})
        pos = {g: p for p, g in enumerate(rows)}
        plans.append(ShardPlan(rows, [(e, k, [pos[i] for i in ids]) for e, k, ids in steps], mb))
    return plans


def _allreduce(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def _allreduce_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def sharded_update(
    *,
    adapter: Any,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    loss_fn: Any,
    recipe: Any,
    sampling_params: Any,
    data: dict[str, torch.Tensor],
    plan: ShardPlan,
    step: int,
    correction: str | None = None,
) -> dict[str, float]:
    """One rank's share of the update; every rank returns the same (globally reduced) metrics.

    ``data`` holds this rank's rows: ``latents`` (n, W+1, ...), ``log_probs``, ``sigmas``,
    ``sigmas_next`` (n, W), ``advantages`` (n,) and ``condition.<key>`` tensors.

    ``correction`` (async mode, stale samples): ``"decoupled"`` recomputes the proximal
    log-probs pi_prox under the current weights (no grad) and uses them as the PPO
    ``old_log_prob``, with ``omni_algos.correction.rollout_correction(pi_prox, pi_rollout)``
    weights on the loss (decoupled PPO, Hilton et al. 2021, arXiv 2110.00641); ``"bypass"``
    keeps the rollout log-probs as ``old_log_prob`` and only applies the rejection mask.
    """
    from omni_algos import sde

    from ..trainer import _call_loss

    r = recipe
    a = r.algorithm
    world = dist.get_world_size() if dist.is_initialized() else 1
    lat = data["latents"]
    old_lp = data["log_probs"].float()
    sig = data["sigmas"].float()
    sig_next = data["sigmas_next"].float()
    adv = data["advantages"].float()
    cond = {k.removeprefix("condition."): v for k, v in data.items() if k.startswith("condition.")}
    n_rows, W = old_lp.shape
    M = plan.minibatch_size

    def replay(idx: torch.Tensor, j: int, prev: torch.Tensor) -> Any:
        c = {key: v[idx] for key, v in cond.items()}
        v = adapter.replay_velocity(lat[idx, j], sig[idx, j], c, sampling_params)
        return sde.step(
            lat[idx, j],
            v,
            sig[idx, j],
            sig_next[idx, j],
            noise_level=r.rollout.noise_level,
            kind=r.rollout.sde_kind,
            prev_sample=prev,
        )

    corr_weights = None
    prox = old_lp
    corr_metrics: dict[str, float] = {}
    if correction is not None:
        import inspect

        from omni_algos.correction import rollout_correction

        if "weights" not in inspect.signature(loss_fn).parameters:
            raise TrainError(
                f"trainer.mode: async needs a loss with per-sample `weights`; "
                f"algorithm.name={a.name!r} has none"
            )
        all_idx = torch.arange(n_rows)
        with torch.no_grad():
            prox = torch.stack(
                [replay(all_idx, j, lat[:, j + 1]).log_prob.float() for j in range(W)], dim=1
            )
        cc = rollout_correction(prox, old_lp, mode=correction, is_level="token")
        corr_weights = cc.weights.float()
        if correction == "bypass":
            prox = old_lp
        keys = sorted(cc.metrics)
        red = _allreduce([cc.metrics[k] * n_rows for k in keys] + [float(n_rows)])
        corr_metrics = {f"async/correction_{k}": red[i] / red[-1] for i, k in enumerate(keys)}

    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def acc(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + float(value)
        counts[key] = counts.get(key, 0) + 1

    diff_sum = diff_cnt = 0.0
    diff_max = 0.0
    first = True
    for _, _, pos in plan.steps:
        idx = torch.tensor(pos, dtype=torch.long)
        n_r = len(pos)
        w_r = n_r / M  # this rank's share of the minibatch mean
        optimizer.zero_grad(set_to_none=True)
        loss_local = 0.0
        bad = 0.0
        step_metrics: list[dict[str, float]] = []
        for j in range(W):
            out = replay(idx, j, lat[idx, j + 1])
            if first:
                d = (out.log_prob.detach() - old_lp[idx, j]).abs()
                diff_sum += float(d.sum())
                diff_cnt += d.numel()
                diff_max = max(diff_max, float(d.max()) if d.numel() else 0.0)
            kwargs: dict[str, Any] = dict(
                log_prob=out.log_prob,
                old_log_prob=prox[idx, j],
                advantages=adv[idx],
                clip_range=a.clip_range,
                adv_clip_max=a.adv_clip_max,
                **a.options,
            )
            if corr_weights is not None:
                kwargs["weights"] = corr_weights[idx, j]
            lo = _call_loss(loss_fn, **kwargs)
            if not torch.isfinite(lo.loss):
                bad = 1.0
            (lo.loss * (w_r * world / W)).backward()
            loss_local += float(lo.loss.detach()) / W * w_r
            step_metrics.append({k: float(v) * w_r for k, v in lo.metrics.items()})
        keys = sorted(step_metrics[0]) if step_metrics else []
        flat = [loss_local, bad] + [m[k] for m in step_metrics for k in keys]
        red = _allreduce(flat)
        if red[1] > 0:
            raise NonFiniteError(f"step {step}: loss is not finite on some rank")
        gn = _full(torch.nn.utils.clip_grad_norm_(params, r.optimizer.grad_clip))
        if not torch.isfinite(gn):
            raise NonFiniteError(f"step {step}: gradient norm is {float(gn)}")
        optimizer.step()
        acc("loss", red[0])
        acc("actor/grad_norm", float(gn))
        for jj in range(len(step_metrics)):
            for i, k in enumerate(keys):
                acc(f"actor/{k}", red[2 + jj * len(keys) + i])
        first = False
    optimizer.zero_grad(set_to_none=True)
    metrics = {k: sums[k] / counts[k] for k in sums}
    s, c = _allreduce([diff_sum, diff_cnt])
    metrics["rollout/logprob_diff_max"] = _allreduce_max(diff_max)
    metrics["rollout/logprob_diff_mean"] = s / max(c, 1.0)
    metrics.update(corr_metrics)
    return metrics
