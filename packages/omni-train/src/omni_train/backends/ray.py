"""`trainer.backend: ray`: the ports as pools of Ray actors.

Roles (each a pool of actors, sized by `trainer.num_workers` / `trainer.resource_pools`):

- actor (`RayLearner`): one rank each of a torch.distributed group, the policy sharded with
  FSDP2 (`fsdp.shard_adapter`). Each rank runs `omni_train.updates.run_update`, the same
  update as the local backend, on its rows of the batch with `fsdp.DistCollective`.
- rollout (`RayDiffusionRollout` / `RayTokenRollout`): each actor holds its own copy of the
  policy (an `EmbeddedEngine`, or a thinker sampler); requests are split over the pool in
  order, and every sample keeps its own seed, so the split changes nothing.
- reward (`RayReward`): the recipe's reward; the batch is split over the pool.

The training loop (`omni_train.loops`) is the local one; only these ports differ.

Weight sync: the actor ranks gather the rollout weights (LoRA tensors, or every trainable
weight) and the driver pushes them with a version to every rollout actor; the driver keeps the
last version, so a restarted rollout actor is brought to it before it serves again.

Fault handling: a rollout or reward actor that dies mid-step is replaced by a fresh one (up to
`trainer.max_restarts` per call), brought to the current weights, and its share is submitted
again; results are checked for count and order.

Everything crossing a process boundary is JSON or safetensors bytes (no pickle of our data).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..algorithms import algorithm
from ..checkpoint import optimizer_state_from_safe, optimizer_state_to_safe
from ..errors import NonFiniteError, TrainError
from ..lr_schedule import apply_learning_rate
from ..models import build_optimizer, ensure_model, load_policy, load_trainable
from ..ports import Ports
from ..recipe import Recipe
from ..updates import (
    RowsBudget,
    UpdateContext,
    UpdatePlan,
    UpdateSettings,
    batch_from_wire,
    batch_to_wire,
    rows_budget,
    run_update,
    select_rows,
    update_plans,
)
from .ray_runtime import WORKER_RUNTIME_ENV

__all__ = [
    "ActorWorker",
    "RayDiffusionRollout",
    "RayLearner",
    "RayReward",
    "RayTokenRollout",
    "RewardWorker",
    "RolloutWorker",
    "ShardedWeights",
    "WorkerPool",
    "ensure_ray",
    "make_ray_ports",
    "pool_sizes",
    "start_ray",
]

ROLES = ("actor", "rollout", "reward")

# Under `uv run`, Ray zips the working directory and rebuilds the uv environment for every
# worker. Our workers run in this very environment, so that is minutes of wasted start-up. Ray
# reads the switch when it is first imported, hence here, before any `import ray`.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def _recipe(recipe_json: str) -> Recipe:
    return Recipe.model_validate_json(recipe_json)


def _threads(recipe: Recipe) -> None:
    threads = recipe.trainer.threads
    torch.set_num_threads(threads if isinstance(threads, int) else 1)


def pool_sizes(recipe: Recipe) -> dict[str, dict[str, float]]:
    """Per role: workers, gpus_per_worker, cpus_per_worker (recipe pools over the defaults).

    Defaults: actor and rollout get `trainer.num_workers` workers; on GPU (gpus_per_node > 0)
    actor and rollout share each GPU (0.5 + 0.5, rollout memory sleeps during the update);
    one reward worker without a GPU. With `rollout.backend` http or vllm-omni no rollout pool
    starts (a server or vllm-omni samples): 0 rollout workers, none of the cluster's GPUs."""
    t = recipe.trainer
    gpu = t.gpus_per_node > 0
    out = {
        "actor": {"workers": t.num_workers, "gpus_per_worker": 0.5 if gpu else 0.0},
        "rollout": {"workers": t.num_workers, "gpus_per_worker": 0.5 if gpu else 0.0},
        "reward": {"workers": 1, "gpus_per_worker": 0.0},
    }
    for role in ROLES:
        out[role]["cpus_per_worker"] = 0.0
        pool = t.resource_pools.get(role)  # type: ignore[call-overload]
        if pool is not None:
            out[role].update(pool.model_dump())
    if recipe.rollout.backend != "embedded":
        out["rollout"]["workers"] = 0
    total_gpus = sum(v["workers"] * v["gpus_per_worker"] for v in out.values())
    if gpu and total_gpus > t.nnodes * t.gpus_per_node + 1e-9:
        raise TrainError(
            f"trainer.resource_pools: the roles ask for {total_gpus:g} GPUs but the cluster has "
            f"trainer.nnodes * trainer.gpus_per_node = {t.nnodes * t.gpus_per_node}"
        )
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _pack(tensors: dict[str, Tensor], meta: dict[str, Any] | None = None) -> bytes:
    from diffusion_rollout.wire import tensors_to_bytes

    return tensors_to_bytes(tensors, {k: json.dumps(v) for k, v in (meta or {}).items()})


def _unpack(payload: bytes) -> tuple[dict[str, Tensor], dict[str, Any]]:
    from diffusion_rollout.wire import tensors_from_bytes

    tensors, meta = tensors_from_bytes(payload)
    return tensors, {k: json.loads(v) for k, v in meta.items()}


# ---------------------------------------------------------------------------------------------
# the workers (plain classes; `ray.remote` is applied when the pools start them)


class ActorWorker:
    """One FSDP2 rank: the trainable policy, its optimizer, its share of each update."""

    def __init__(self, recipe_json: str, rank: int, world_size: int) -> None:
        self.recipe = _recipe(recipe_json)
        self.rank = rank
        self.world_size = world_size
        _threads(self.recipe)
        self.timeline: list[tuple[str, float, float]] = []
        self.rows_budget: RowsBudget | None = None  # rows_per_forward: auto (configure)

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, addr: str, port: int) -> int:
        from . import fsdp

        r = self.recipe
        if r.model.device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        self.adapter = load_policy(r)
        gpu = self.adapter.device.type == "cuda"
        fsdp.init_process_group(
            self.rank, self.world_size, addr, port, backend="nccl" if gpu else "gloo"
        )
        # GPU: the adapter's FSDP2 mixed precision (bf16 compute, fp32 reduce); CPU: exact
        units = fsdp.shard_adapter(self.adapter, mixed_precision=gpu)
        self.configure(self.recipe.model_dump_json())
        return units

    def configure(self, recipe_json: str) -> None:
        """Train under this recipe's algorithm and optimizer settings (same model and LoRA),
        with a fresh optimizer."""
        from . import fsdp
        from .local import allowed_token_ids

        self.recipe = r = _recipe(recipe_json)
        if self.rows_budget is not None:
            self.rows_budget.close()
        self.rows_budget = rows_budget(r, self.adapter)
        self.params_named = self.adapter.named_trainable_parameters()
        self.optimizer = build_optimizer(list(self.params_named.values()), r)
        alg = algorithm(r.algorithm.name)
        allowed = allowed_token_ids(self.adapter, r) if alg.model == "omni" else None
        self.ctx = UpdateContext(
            self.adapter,
            self.optimizer,
            list(self.params_named.values()),
            alg,
            UpdateSettings.from_recipe(r, allowed),
            fsdp.DistCollective(),
        )

    def update(self, payload: bytes, step: int, correction: str | None = None) -> dict[str, float]:
        from diffusion_rollout.wire import tensors_from_bytes

        t0 = time.time()
        tensors, meta = tensors_from_bytes(payload)
        plan = UpdatePlan.from_json(json.loads(meta.pop("plan")))
        dev = self.adapter.device
        batch = batch_from_wire({k: v.to(dev) for k, v in tensors.items()}, meta)
        lr = apply_learning_rate(self.optimizer, self.recipe, step)
        metrics = {**run_update(self.ctx, batch, plan, correction=correction), "optim/lr": lr}
        if self.rows_budget is not None:  # this rank's measure; the driver plans with the least
            metrics["perf/rows_fit"] = float(self.rows_budget.rows_fit() or 0)
        self.timeline.append((f"update{step}", t0, time.time()))
        return metrics

    def export_weights(self, fmt: str = "omni") -> bytes:
        """The rollout weights, gathered (a collective; rank 0 returns the bytes)."""
        from . import fsdp

        tensors = fsdp.gather_rollout_weights(self.adapter, fmt)
        return _pack(tensors) if self.rank == 0 else b""

    def local_shards(self, fmt: str = "omni") -> bytes:
        """This rank's own pieces of the rollout weights, no collective: the local shard of
        each sharded tensor (and, on rank 0, the whole of each replicated one), with the
        dim it is sharded on and the whole shape (`assemble_shards` puts them together)."""
        from torch.distributed.tensor import DTensor, Shard

        tensors, layout = {}, {}
        for name, t in self.adapter.export_rollout_weights(fmt, gather=False).items():
            if isinstance(t, DTensor):
                shard = [p.dim for p in t.placements if isinstance(p, Shard)]
                if shard:
                    tensors[name] = t.to_local().to("cpu", torch.float32).contiguous()
                    layout[name] = {"dim": shard[0], "shape": list(t.shape)}
                    continue
                t = t.to_local()
            if self.rank == 0:
                tensors[name] = t.to("cpu", torch.float32).contiguous()
                layout[name] = {"dim": None, "shape": list(t.shape)}
        return _pack(tensors, {"layout": layout, "rank": self.rank})

    def lora_config(self) -> str:
        return json.dumps(self.adapter.lora_config() if self.recipe.lora.enabled else None)

    def state(self) -> bytes:
        """Trainable parameters and AdamW state, gathered whole (a collective; rank 0
        returns them): the local backend's checkpoint layout."""
        from . import fsdp

        trainable = fsdp.full_tensors(dict(self.params_named))
        opt_tensors, opt_meta = optimizer_state_to_safe(fsdp.gather_optimizer_state(self.optimizer))
        if self.rank != 0:
            return b""
        tensors = {f"trainable.{k}": v for k, v in trainable.items()}
        tensors.update({f"optimizer.{k}": v for k, v in opt_tensors.items()})
        return _pack(tensors, {"optimizer": opt_meta})

    def load_state(self, payload: bytes) -> None:
        """Inverse of `state`: every rank loads the whole tensors and keeps its shards."""
        from . import fsdp

        tensors, meta = _unpack(payload)
        trainable = {
            k.removeprefix("trainable."): v
            for k, v in tensors.items()
            if k.startswith("trainable.")
        }
        load_trainable(self.adapter, self.params_named, trainable, self.recipe)
        if "optimizer" in meta:
            opt = {
                k.removeprefix("optimizer."): v
                for k, v in tensors.items()
                if k.startswith("optimizer.")
            }
            fsdp.load_optimizer_state(
                self.optimizer, optimizer_state_from_safe(opt, meta["optimizer"])
            )

    def get_timeline(self) -> list[tuple[str, float, float]]:
        return list(self.timeline)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class RolloutWorker:
    """Its own copy of the policy: an `EmbeddedEngine` (diffusion) or a thinker sampler."""

    def __init__(self, recipe_json: str, index: int) -> None:
        from .local import ThinkerRollout, allowed_token_ids

        self.recipe = _recipe(recipe_json)
        self.index = index
        _threads(self.recipe)
        self.adapter = load_policy(self.recipe)
        self.adapter.set_trainable("frozen")
        self.version = 0
        self.timeline: list[tuple[str, float, float]] = []
        self.asleep = False
        if algorithm(self.recipe.algorithm.name).model == "omni":
            allowed = allowed_token_ids(self.adapter, self.recipe)
            self.sampler: Any = ThinkerRollout(self.adapter, self.recipe, allowed)
            self.engine = None
        else:
            from diffusion_rollout import EmbeddedEngine

            if self.recipe.lora.enabled:  # sample with the adapter merged (base-model speed)
                self.adapter.merge_lora()
            self.engine = EmbeddedEngine(
                self.adapter, max_num_seqs=self.recipe.rollout.max_num_seqs
            )

    def ready(self) -> int:
        return self.version

    def generate(self, requests_json: str, tag: str = "") -> dict[str, Any]:
        """Roll out a chunk of diffusion requests: ``{"trajectories": [bytes], "forwards",
        "rows"}`` (the engine's forward count and packed rows for this chunk)."""
        from diffusion_rollout import RolloutRequest
        from diffusion_rollout.wire import trajectory_to_bytes

        if self.asleep:
            raise RuntimeError(f"rollout worker {self.index} is asleep; wake() it first")
        t0 = time.time()
        reqs = [RolloutRequest.from_dict(d) for d in json.loads(requests_json)]
        before = self.engine.stats()
        trajs = self.engine.generate_many(reqs)
        after = self.engine.stats()
        self.timeline.append((tag, t0, time.time()))
        return {
            "trajectories": [trajectory_to_bytes(t) for t in trajs],
            "forwards": int(after["forwards"] - before["forwards"]),
            "rows": int(after["rows"] - before["rows"]),
        }

    def generate_tokens(
        self, items: bytes, seeds: list[int], temperature: float, top_p: float
    ) -> bytes:
        """Sample responses for a chunk of questions (thinker models)."""
        got = self.sampler.generate(
            _items_from_bytes(items), seeds, temperature=temperature, top_p=top_p
        )
        tensors = {k: got[k] for k in ("tokens", "log_probs", "mask")}
        meta = {
            "texts": got["texts"],
            "temperature": got["temperature"],
            "forwards": got["forwards"],
        }
        return _pack(tensors, meta)

    def update_weights(self, payload: bytes, version: int) -> str:
        """Load a weight version; returns the checksum of what was loaded. Re-sending the
        current version reloads it (a restarted worker catching up)."""
        from omni_adapters import weights_checksum

        tensors, _ = _unpack(payload)
        self._load(tensors, version)
        return weights_checksum(tensors)

    def _load(self, tensors: dict[str, Tensor], version: int) -> None:
        if self.engine is not None and version > self.engine.version:
            self.engine.update_weights(tensors, version=version)
        else:
            with torch.no_grad():
                self.adapter.load_weights(tensors)
        self.version = version

    def load_shards(self, version: int, *shards: bytes) -> str:
        """Load a version from the FSDP ranks' own pieces (Ray fetches each ref from its rank)."""
        from omni_adapters import weights_checksum

        tensors = assemble_shards(list(shards))
        self._load(tensors, version)
        return weights_checksum(tensors)

    def checksum(self) -> str:
        """`weights_checksum` of the rollout weights this worker now holds."""
        from omni_adapters import weights_checksum

        return weights_checksum(self.adapter.export_rollout_weights())

    def sleep(self) -> None:
        """Release the rollout's accelerator memory between phases (weights move to CPU)."""
        if self.adapter.device.type == "cuda":
            self.adapter.to("cpu")
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        if torch.cuda.is_available() and self.recipe.model.device.startswith("cuda"):
            self.adapter.to("cuda")
        self.asleep = False

    def get_timeline(self) -> list[tuple[str, float, float]]:
        return list(self.timeline)


class RewardWorker:
    """The recipe's reward; scores chunks sent in `omni_rewards.wire`'s JSON."""

    def __init__(self, recipe_json: str, index: int) -> None:
        from ..rewards import build_reward

        self.recipe = _recipe(recipe_json)
        self.index = index
        _threads(self.recipe)
        self.reward = build_reward(self.recipe)

    def ready(self) -> bool:
        return True

    def score(self, request_json: str) -> str:
        from omni_rewards.wire import decode_input

        return json.dumps(self.reward(decode_input(json.loads(request_json))).to_json())


def assemble_shards(payloads: list[bytes]) -> dict[str, Tensor]:
    """Whole tensors from every rank's `ActorWorker.local_shards`: each sharded tensor is its
    ranks' pieces concatenated in rank order along its shard dim (checked against the whole
    shape); a replicated one is rank 0's."""
    parts = sorted((_unpack(p) for p in payloads), key=lambda tm: tm[1]["rank"])
    layout: dict[str, Any] = {}
    for _, meta in parts:
        layout.update(meta["layout"])
    out = {}
    for name, info in layout.items():
        if info["dim"] is None:
            out[name] = parts[0][0][name]
            continue
        pieces = [tensors[name] for tensors, _ in parts if name in tensors]
        whole = torch.cat(pieces, info["dim"])
        if list(whole.shape) != info["shape"]:
            raise TrainError(
                f"weight sync: {name} assembled to {list(whole.shape)}, not {info['shape']}"
            )
        out[name] = whole
    return out


class ShardedWeights:
    """The rollout weights as Ray object refs, one per FSDP rank (`ActorWorker.local_shards`):
    handed to the rollout workers, which fetch the pieces straight from the ranks and put them
    together; the bytes never pass through the driver. `whole()` gathers them here for a
    rollout that is not a Ray pool (an HTTP server, a checkpoint)."""

    def __init__(self, refs: list[Any]) -> None:
        self.refs = refs

    def whole(self) -> dict[str, Tensor]:
        import ray

        return assemble_shards(ray.get(self.refs))


def _items_to_bytes(items: list[Any]) -> bytes:
    tensors = {
        f"image.{i}": torch.from_numpy(np.ascontiguousarray(it.image))
        for i, it in enumerate(items)
        if it.image is not None
    }
    rows = [{"prompt": it.prompt, "answer": it.answer} for it in items]
    return _pack(tensors, {"rows": rows})


def _items_from_bytes(payload: bytes) -> list[Any]:
    from ..tasks import OmniItem

    tensors, meta = _unpack(payload)
    out = []
    for i, row in enumerate(meta["rows"]):
        image = tensors.get(f"image.{i}")
        out.append(OmniItem(row["prompt"], row["answer"], None if image is None else image.numpy()))
    return out


# ---------------------------------------------------------------------------------------------
# pools with restart + resubmit


def _dead(exc: BaseException) -> bool:
    import ray

    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


class WorkerPool:
    """Ray actors of one role. `submit` fans work out; `Pending.result` restarts dead actors.

    `before_submit(pool)` (tests) runs once, just before the next work is submitted: a test kills
    an actor there, so the step meets a dead worker whatever the timing of the kill."""

    def __init__(
        self,
        role: str,
        cls: type,
        make_args: Callable[[int], tuple],
        size: int,
        resources: dict[str, float],
        max_restarts: int,
        on_restart: Callable[[int], None] | None = None,
    ) -> None:
        import ray

        self.role = role
        self.remote_cls = ray.remote(cls)
        self.make_args = make_args
        self.resources = resources
        self.max_restarts = max_restarts
        self.on_restart = on_restart
        self.before_submit: Callable[[WorkerPool], None] | None = None
        self.restarts = 0
        self.handles = [self._start(i) for i in range(size)]

    def _start(self, i: int) -> Any:
        return self.remote_cls.options(
            num_cpus=self.resources.get("cpus_per_worker", 0.0),
            num_gpus=self.resources.get("gpus_per_worker", 0.0),
            max_restarts=0,
        ).remote(*self.make_args(i))

    def __len__(self) -> int:
        return len(self.handles)

    def restart(self, i: int) -> None:
        import ray

        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.handles[i])
        self.handles[i] = self._start(i)
        self.restarts += 1
        if self.on_restart is not None:
            self.on_restart(i)

    def submit(self, method: str, chunks: list[tuple[int, tuple]]) -> Pending:
        """Start `method(*args)` for each `(worker index, args)` without waiting."""
        if self.before_submit is not None:
            hook, self.before_submit = self.before_submit, None  # fire once
            hook(self)
        refs = [getattr(self.handles[i], method).remote(*args) for i, args in chunks]
        return Pending(self, method, chunks, refs)

    def call_all(self, method: str, chunks: list[tuple[int, tuple]]) -> list[Any]:
        """`submit(...).result()`."""
        return self.submit(method, chunks).result()

    def close(self) -> None:
        import ray

        for h in self.handles:
            with contextlib.suppress(Exception):
                ray.kill(h)


class Pending:
    """Work submitted to a pool. `result()` waits; a chunk whose actor died is resubmitted to
    a restarted actor (at most `max_restarts` restarts per call, then TrainError)."""

    def __init__(self, pool: WorkerPool, method: str, chunks: list[tuple[int, tuple]], refs: list):
        self.pool, self.method, self.chunks, self.refs = pool, method, chunks, refs

    def result(self) -> list[Any]:
        import ray

        pool, chunks, refs = self.pool, self.chunks, self.refs
        results: list[Any] = [None] * len(chunks)
        pending = list(range(len(chunks)))
        budget = pool.max_restarts
        while pending:
            retry = []
            for c in pending:
                try:
                    results[c] = ray.get(refs[c])
                except Exception as exc:
                    if not _dead(exc):
                        raise
                    retry.append(c)
            if not retry:
                break
            dead = sorted({chunks[c][0] for c in retry})
            if len(dead) > budget:
                raise TrainError(
                    f"{pool.role} worker(s) {dead} died and trainer.max_restarts="
                    f"{pool.max_restarts} restarts are used up in this step"
                )
            budget -= len(dead)
            for i in dead:
                pool.restart(i)
            for c in retry:
                i, args = chunks[c]
                refs[c] = getattr(pool.handles[i], self.method).remote(*args)
            pending = retry
        return results


def _split(n: int, parts: int) -> list[range]:
    """Contiguous ranges, sizes differing by at most one (empty ranges dropped)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        if size:
            out.append(range(start, start + size))
        start += size
    return out


# ---------------------------------------------------------------------------------------------
# the ports


class _RolloutPool:
    """The rollout actors, with the last weights kept for restarted ones."""

    def __init__(self, recipe_json: str, resources: dict[str, float], max_restarts: int) -> None:
        import ray

        self.version = 0
        self._weights: bytes | None = None
        self.pool = WorkerPool(
            "rollout",
            RolloutWorker,
            lambda i: (recipe_json, i),
            int(resources["workers"]),
            resources,
            max_restarts,
            on_restart=self._bring_up,
        )
        ray.get([h.ready.remote() for h in self.pool.handles])

    def _bring_up(self, i: int) -> None:
        import ray

        if self._weights is not None:
            ray.get(self._push(i, self._weights, self.version))

    def _push(self, i: int, weights: Any, version: int) -> Any:
        handle = self.pool.handles[i]
        if isinstance(weights, ShardedWeights):  # rank-local: straight from the FSDP ranks
            return handle.load_shards.remote(version, *weights.refs)
        return handle.update_weights.remote(weights, version)

    def update_weights(self, tensors: dict[str, Tensor] | ShardedWeights, version: int) -> None:
        """Push a weight version to every rollout actor (each actor's queue order, so work
        submitted afterwards runs on it): the FSDP ranks' own pieces (`ShardedWeights`), or
        whole tensors. A worker loads a version only once it has all of it."""
        import ray

        weights = tensors if isinstance(tensors, ShardedWeights) else _pack(tensors)
        self._weights, self.version = weights, version
        ray.get([self._push(i, weights, version) for i in range(len(self.pool))])

    def sleep(self) -> None:
        self.pool.call_all("sleep", [(i, ()) for i in range(len(self.pool))])

    def wake(self) -> None:
        self.pool.call_all("wake", [(i, ()) for i in range(len(self.pool))])

    def timelines(self) -> list[tuple[str, float, float]]:
        import ray

        return [e for h in self.pool.handles for e in ray.get(h.get_timeline.remote())]

    def close(self) -> None:
        self.pool.close()


class RayDiffusionRollout(_RolloutPool):
    """Diffusion rollout over the pool: `generate_many` splits the requests (order kept)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._forwards = self._rows = 0

    def generate_many(self, requests: list[Any]) -> list[Any]:
        from diffusion_rollout.wire import trajectory_from_bytes

        requests = list(requests)
        tag = str(requests[0].request_id).split("-")[0] if requests else ""
        ranges = _split(len(requests), len(self.pool))
        chunks = [
            (w, (json.dumps([requests[i].to_dict() for i in rg]), tag))
            for w, rg in enumerate(ranges)
        ]
        parts = self.pool.call_all("generate", chunks)
        out = []
        for rg, part in zip(ranges, parts):
            blobs = part["trajectories"]
            if len(blobs) != len(rg):
                raise TrainError(f"rollout: a worker returned {len(blobs)} of {len(rg)} samples")
            out.extend(trajectory_from_bytes(b) for b in blobs)
            self._forwards += part["forwards"]
            self._rows += part["rows"]
        for req, t in zip(requests, out):
            if t.request_id != req.request_id:
                raise TrainError(f"rollout: result {t.request_id} out of order ({req.request_id})")
        return out

    def stats(self) -> dict[str, Any]:
        """Driver-side totals like `EmbeddedEngine.stats()` (no call to the workers)."""
        return {
            "workers": len(self.pool),
            "restarts": self.pool.restarts,
            "version": self.version,
            "forwards": self._forwards,
            "rows": self._rows,
        }


class RayTokenRollout(_RolloutPool):
    """Thinker sampling over the pool (`omni_train.ports.TokenRollout`)."""

    def generate(
        self, items: list[Any], seeds: list[int], *, temperature: float, top_p: float
    ) -> dict[str, Any]:
        ranges = _split(len(items), len(self.pool))
        chunks = [
            (
                w,
                (
                    _items_to_bytes([items[i] for i in rg]),
                    [seeds[i] for i in rg],
                    temperature,
                    top_p,
                ),
            )
            for w, rg in enumerate(ranges)
        ]
        parts = [_unpack(b) for b in self.pool.call_all("generate_tokens", chunks)]
        return {
            "tokens": torch.cat([t["tokens"] for t, _ in parts]),
            "log_probs": torch.cat([t["log_probs"] for t, _ in parts]),
            "mask": torch.cat([t["mask"] for t, _ in parts]),
            "texts": [x for _, m in parts for x in m["texts"]],
            "temperature": parts[0][1]["temperature"],
            "forwards": max(m["forwards"] for _, m in parts),
        }


class RayReward:
    """The reward over the reward pool: callable on a `RewardInput`, the batch split."""

    def __init__(self, recipe_json: str, resources: dict[str, float], max_restarts: int) -> None:
        import ray

        self.pool = WorkerPool(
            "reward",
            RewardWorker,
            lambda i: (recipe_json, i),
            int(resources["workers"]),
            resources,
            max_restarts,
        )
        ray.get([h.ready.remote() for h in self.pool.handles])

    def __call__(self, inp: Any) -> Any:
        from omni_rewards import RewardOutput
        from omni_rewards.wire import encode_input

        ranges = _split(len(inp), len(self.pool))
        chunks = [
            (w, (json.dumps(encode_input(inp.slice(rg.start, rg.stop))),))
            for w, rg in enumerate(ranges)
        ]
        parts = self.pool.call_all("score", chunks)
        out = RewardOutput.concat([RewardOutput.from_json(json.loads(p)) for p in parts])
        if len(out) != len(inp):
            raise TrainError(f"reward: {len(out)} scores for {len(inp)} samples")
        return out

    def close(self) -> None:
        self.pool.close()


class RayLearner:
    """The FSDP2 actor ranks (`omni_train.ports.Learner`)."""

    def __init__(self, recipe: Recipe, resources: dict[str, float]) -> None:
        import ray

        self.recipe = recipe
        self.world_size = int(resources["workers"])
        self.rows_fit: int | None = None  # rows_per_forward: auto, from the ranks' measures
        rj = recipe.model_dump_json()
        cls = ray.remote(ActorWorker)
        self.actors = [
            cls.options(
                num_cpus=resources["cpus_per_worker"], num_gpus=resources["gpus_per_worker"]
            ).remote(rj, rank, self.world_size)
            for rank in range(self.world_size)
        ]
        addr, port = ray.get(self.actors[0].address.remote())
        ray.get([a.setup.remote(addr, port) for a in self.actors])

    def configure(self, recipe: Recipe) -> None:
        """Train the same model and LoRA under another recipe's algorithm and optimizer
        settings, with a fresh optimizer (e.g. one worker pool for several experiments)."""
        import ray

        self.recipe = recipe
        self.rows_fit = None
        ray.get([a.configure.remote(recipe.model_dump_json()) for a in self.actors])

    def update(self, batch: Any, step: int, correction: str | None = None) -> dict[str, float]:
        import ray

        from diffusion_rollout.wire import tensors_to_bytes

        plans = update_plans(self.recipe, batch, step, self.world_size, rows_fit=self.rows_fit)
        refs = []
        for actor, plan in zip(self.actors, plans):
            tensors, meta = batch_to_wire(select_rows(batch, plan.rows))
            meta["plan"] = json.dumps(plan.to_json())
            refs.append(actor.update.remote(tensors_to_bytes(tensors, meta), step, correction))
        try:
            ranks = [dict(m) for m in ray.get(refs)]
            if "perf/rows_fit" in ranks[0]:  # rows_per_forward: auto, the same for every rank
                self.rows_fit = int(min(m["perf/rows_fit"] for m in ranks)) or None
                ranks[0]["perf/rows_fit"] = float(self.rows_fit or 0)
            return ranks[0]
        except Exception as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, NonFiniteError):
                raise NonFiniteError(str(cause)) from None
            raise

    def rollout_weights(self) -> ShardedWeights:
        """Each rank's own pieces, as refs (no gather: see `ShardedWeights`)."""
        return ShardedWeights([a.local_shards.remote() for a in self.actors])

    def lora_config(self) -> dict[str, Any] | None:
        import ray

        return json.loads(ray.get(self.actors[0].lora_config.remote()))

    def lora_export(self) -> tuple[dict[str, Tensor], dict[str, Any]] | None:
        import ray

        if not self.recipe.lora.enabled:
            return None
        blobs = ray.get([a.export_weights.remote("peft") for a in self.actors])
        return _unpack(blobs[0])[0], json.loads(ray.get(self.actors[0].lora_config.remote()))

    def state(self) -> tuple[dict[str, Tensor], dict[str, Any] | None]:
        import ray

        tensors, meta = _unpack(ray.get([a.state.remote() for a in self.actors])[0])
        trainable = {
            k.removeprefix("trainable."): v
            for k, v in tensors.items()
            if k.startswith("trainable.")
        }
        opt = {
            k.removeprefix("optimizer."): v
            for k, v in tensors.items()
            if k.startswith("optimizer.")
        }
        return trainable, optimizer_state_from_safe(opt, meta["optimizer"])

    def load_state(self, trainable: dict[str, Tensor], optimizer: dict[str, Any] | None) -> None:
        import ray

        tensors = {f"trainable.{k}": v for k, v in trainable.items()}
        meta: dict[str, Any] = {}
        if optimizer is not None:
            opt_tensors, meta["optimizer"] = optimizer_state_to_safe(optimizer)
            tensors.update({f"optimizer.{k}": v for k, v in opt_tensors.items()})
        payload = _pack(tensors, meta)
        ray.get([a.load_state.remote(payload) for a in self.actors])

    @contextlib.contextmanager
    def eval_weights(self) -> Iterator[None]:
        yield  # no EMA on this backend (refused by the recipe check)

    def timelines(self) -> list[tuple[str, float, float]]:
        import ray

        return [e for a in self.actors for e in ray.get(a.get_timeline.remote())]

    def close(self) -> None:
        import ray

        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.get(a.close.remote(), timeout=30)
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.actors = []


def start_ray(num_cpus: int, num_gpus: int | None = None, attempts: int = 3) -> None:
    """Start a local Ray cluster. Ray gives its raylet a fixed 30 s to register, which a busy
    machine can miss; the start is tried again (after a clean shutdown) before giving up."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env=WORKER_RUNTIME_ENV,
            )
            return
        except Exception as exc:  # Ray raises a bare Exception for the start-up timeout
            ray.shutdown()
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise TrainError(
                    f"trainer.backend ray: the local Ray cluster did not start: {exc}"
                ) from None
            time.sleep(2.0 * attempt)


def ensure_ray(recipe: Recipe) -> bool:
    """Connect to the Ray cluster (`RAY_ADDRESS`) or start a local one; True if started here."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(
            address=os.environ["RAY_ADDRESS"],
            include_dashboard=False,
            runtime_env=WORKER_RUNTIME_ENV,
        )
    else:
        start_ray(max(2, os.cpu_count() or 2), recipe.trainer.gpus_per_node or None)
    return True


def make_ray_ports(recipe: Recipe) -> Ports:
    """Learner, rollout and reward pools of `trainer.backend: ray`."""
    try:
        import ray
    except ModuleNotFoundError:
        raise TrainError(
            "trainer.backend: 'ray' needs Ray: pip install 'omni-train[ray]'"
        ) from None
    from omni_adapters import adapter_for, read_architecture

    r = recipe
    path = ensure_model(r)  # build the tiny model once, before the workers look for it
    needs_images = bool(getattr(adapter_for(read_architecture(path)), "needs_images", False))
    sizes = pool_sizes(r)
    own_ray = ensure_ray(r)
    closers: list[Callable[[], None]] = []
    if own_ray:
        closers.append(ray.shutdown)
    try:
        rj = r.model_dump_json()
        learner = RayLearner(r, sizes["actor"])
        closers.append(learner.close)
        omni = algorithm(r.algorithm.name).model == "omni"
        if r.rollout.backend != "embedded":  # a server or vllm-omni samples
            from .remote_rollout import make_remote_rollout

            rollout: Any = make_remote_rollout(r, path, learner.lora_config())
        else:
            cls = RayTokenRollout if omni else RayDiffusionRollout
            rollout = cls(rj, sizes["rollout"], r.trainer.max_restarts)
        closers.append(rollout.close)
    except BaseException:
        for close in reversed(closers):
            with contextlib.suppress(Exception):
                close()
        raise

    def make_reward() -> RayReward:
        reward = RayReward(rj, sizes["reward"], r.trainer.max_restarts)
        closers.append(reward.close)
        return reward

    return Ports(learner, rollout, make_reward, needs_images=needs_images, closers=closers)
