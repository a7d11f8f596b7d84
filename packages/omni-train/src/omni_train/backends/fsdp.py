"""FSDP2 on the Ray actor ranks: sharding, the all-reducing collective, gathering.

Each actor worker holds one rank of a ``torch.distributed`` process group (gloo on CPU, NCCL
on GPU). The adapter's FSDP wrap units (``OmniModelBase.fsdp_wrap_modules()``) each become one
``fully_shard`` unit, then the root model; LoRA and frozen base weights shard alike. The update
itself is `omni_train.updates.run_update`, the same function the local backend runs, given
`DistCollective`: FSDP2's reduce-scatter averages gradients over ranks, so the collective's
``grad_scale`` is the world size (the algebra is in `omni_train.updates.common`).

Checkpoints hold whole tensors: the trainable parameters and the AdamW moments are gathered
(`full_tensors`, `gather_optimizer_state`) into the same layout the local backend writes, and
`load_optimizer_state` shards them again, so a run resumes on either backend.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DistCollective",
    "full_tensors",
    "gather_optimizer_state",
    "gather_rollout_weights",
    "gather_state_dict",
    "init_process_group",
    "load_optimizer_state",
    "shard_adapter",
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


class DistCollective:
    """The ranks of the default process group (`omni_train.updates.Collective`)."""

    def __init__(self) -> None:
        self.grad_scale = float(dist.get_world_size())

    def _reduce(self, values: Sequence[float], op: Any) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def all_sum(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def all_max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def full_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return _full(t)


def gather_optimizer_state(
    optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` with every sharded state tensor gathered whole (a
    collective: every rank calls it), on CPU: the local backend's layout."""
    sd = optimizer.state_dict()
    state = {
        idx: {k: (_full(v).detach().cpu() if torch.is_tensor(v) else v) for k, v in st.items()}
        for idx, st in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a whole (gathered) optimizer state: each moment is sharded like its parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    sharded: dict[int, dict[str, Any]] = {}
    for idx, st in state["state"].items():
        p = params[int(idx)]
        entry = {}
        for k, v in st.items():
            if torch.is_tensor(v) and isinstance(p, DTensor) and v.shape == p.shape:
                v = distribute_tensor(v.to(p.device_mesh.device_type), p.device_mesh, p.placements)
            entry[k] = v
        sharded[int(idx)] = entry
    optimizer.load_state_dict({"state": sharded, "param_groups": state["param_groups"]})
