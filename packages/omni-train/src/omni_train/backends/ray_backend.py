"""`trainer.backend: ray`: the same FlowGRPO step as `LocalTrainer`, with Ray actors per role.

Roles (each a pool of Ray actors, sized by `trainer.num_workers` / `trainer.resource_pools`):

- actor: one rank each of a torch.distributed group; the policy sharded with FSDP2
  (`fsdp.shard_adapter`) and trained by `fsdp.sharded_update`. The reference policy is the
  same module with the LoRA adapters disabled (`OmniModelBase.reference_policy`).
- rollout: an `EmbeddedEngine` per actor; requests are split over the pool.
- reward: the recipe's reward (`build_reward`); the batch is split over the pool.

The driver is a `LocalTrainer` subclass: `rollout` and `score` are LocalTrainer's own
methods running against `RemoteEngine` / `RemoteReward` stand-ins for `self.engine` /
`self.reward`, so prompts, groups, per-sample seeds (`sample_seed(run_seed, step, global
index)`, never a worker index) and the non-finite checks are the local code. `update` and
`sync_weights` dispatch to the actor pool; `train_step` and `train` are inherited.

Weight sync: the actor pool gathers the LoRA tensors (fast path) or every weight (full)
and the driver pushes them, with a version, to every rollout actor; the driver keeps the
last version so a restarted rollout actor is brought to it before it serves requests.

Fault handling: a rollout or reward actor that dies mid-step is replaced by a fresh one (up to
`trainer.max_restarts` per step), brought to the current weights, and its requests are
submitted again; results are checked for the expected count and order.

Everything crossing a process boundary is JSON or safetensors bytes (no pickle of our data).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import TrainError
from ..recipe import Recipe
from ..trainer import LocalTrainer, StepBatch, _loss_fn, _stack, ensure_model, set_full_trainable

__all__ = [
    "ActorWorker",
    "RayTrainer",
    "RemoteEngine",
    "RemoteReward",
    "RewardWorker",
    "RolloutWorker",
    "WorkerPool",
    "load_policy",
    "pool_sizes",
]

ROLES = ("actor", "rollout", "reward")


# ---------------------------------------------------------------------------------------------
# helpers shared by the workers


def _recipe(recipe_json: str) -> Recipe:
    return Recipe.model_validate_json(recipe_json)


def _threads(recipe: Recipe) -> None:
    torch.set_num_threads(recipe.trainer.threads or 1)


def load_policy(recipe: Recipe) -> Any:
    """The adapter with LoRA (or full fine-tuning) set up exactly as `LocalTrainer.setup`."""
    from omni_adapters import from_pretrained

    r = recipe
    path = ensure_model(r)
    device = r.model.device
    if device.startswith("cuda") and torch.cuda.is_available():
        device = "cuda"
    adapter = from_pretrained(path, dtype=r.model.dtype, device=device, **r.model.options)
    if r.lora.enabled:
        torch.manual_seed(r.lora.init_seed)
        adapter.add_lora(
            r.lora.rank, r.lora.alpha, target_modules=r.lora.target_modules, dropout=r.lora.dropout
        )
    else:
        set_full_trainable(adapter, r)
    return adapter


def pool_sizes(recipe: Recipe) -> dict[str, dict[str, float]]:
    """Per role: workers, gpus_per_worker, cpus_per_worker (recipe pools over the defaults).

    Defaults: actor and rollout get `trainer.num_workers` workers; on GPU (gpus_per_node > 0)
    actor and rollout share each GPU (0.5 + 0.5, rollout memory sleeps during the update);
    one reward worker without a GPU."""
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


def _batch_tensors(trajs: list[Any], rows: list[int], adv: torch.Tensor) -> dict[str, torch.Tensor]:
    from diffusion_rollout import stack_conditions

    sel = [trajs[i] for i in rows]
    out = {
        "latents": _stack(sel, "latents"),
        "log_probs": _stack(sel, "log_probs"),
        "sigmas": _stack(sel, "sigmas"),
        "sigmas_next": _stack(sel, "sigmas_next"),
        "advantages": adv[rows],
    }
    for k, v in stack_conditions([t.condition for t in sel]).items():
        out["condition." + k] = v
    return out


# ---------------------------------------------------------------------------------------------
# the workers (plain classes; `ray.remote` is applied when the pools start them)


class ActorWorker:
    """One FSDP2 rank: the trainable policy, its optimizer, the sharded update."""

    def __init__(self, recipe_json: str, rank: int, world_size: int) -> None:
        self.recipe = _recipe(recipe_json)
        self.rank = rank
        self.world_size = world_size
        _threads(self.recipe)
        self.timeline: list[tuple[str, float, float]] = []

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
        self.params_named = self.adapter.named_trainable_parameters()
        o = r.optimizer
        self.optimizer = torch.optim.AdamW(
            list(self.params_named.values()),
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        self.loss_fn = _loss_fn(r)
        self.sampling = r.sampling_params()
        return units

    def update(self, payload: bytes, step: int, correction: str | None = None) -> dict[str, float]:
        from diffusion_rollout.wire import tensors_from_bytes

        from . import fsdp

        t0 = time.time()
        tensors, meta = tensors_from_bytes(payload)
        p = json.loads(meta["plan"])
        plan = fsdp.ShardPlan(p["rows"], [tuple(s) for s in p["steps"]], p["minibatch_size"])
        dev = self.adapter.device
        tensors = {k: v.to(dev) for k, v in tensors.items()}
        metrics = fsdp.sharded_update(
            adapter=self.adapter,
            optimizer=self.optimizer,
            params=list(self.params_named.values()),
            loss_fn=self.loss_fn,
            recipe=self.recipe,
            sampling_params=self.sampling,
            data=tensors,
            plan=plan,
            step=step,
            correction=correction,
        )
        self.timeline.append((f"update{step}", t0, time.time()))
        return metrics

    def export_weights(self, full: bool = False, fmt: str = "omni") -> bytes:
        """Gather the rollout weights (a collective; rank 0 returns the bytes)."""
        from diffusion_rollout.wire import tensors_to_bytes

        from . import fsdp

        if full:
            tensors = fsdp.gather_state_dict(self.adapter)
        else:
            tensors = fsdp.gather_rollout_weights(self.adapter, fmt)
        if self.rank != 0:
            return b""
        return tensors_to_bytes(tensors, {"full": json.dumps(full)})

    def trainable_state(self) -> bytes:
        """Every trainable parameter, gathered, keyed like `named_trainable_parameters`."""
        from diffusion_rollout.wire import tensors_to_bytes

        from . import fsdp

        tensors = fsdp.full_tensors(dict(self.params_named))
        return tensors_to_bytes(tensors) if self.rank == 0 else b""

    def lora_config(self) -> str:
        return json.dumps(self.adapter.lora_config() if self.recipe.lora.enabled else None)

    def get_timeline(self) -> list[tuple[str, float, float]]:
        return list(self.timeline)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class _SyncTarget:
    """The adapter as the engine's denoiser; `load_weights` takes LoRA tensors (fast path) or,
    with `full` set, a whole state dict of the trainable model."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.full = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.adapter, name)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        if not self.full:
            self.adapter.load_weights(tensors)
            return
        own = self.adapter.model.state_dict()
        unknown = sorted(set(tensors) - set(own))
        missing = sorted(set(own) - set(tensors))
        if unknown or missing:
            raise ValueError(f"full weight sync: unknown {unknown[:3]}, missing {missing[:3]}")
        self.adapter.model.load_state_dict(tensors, strict=True)


class RolloutWorker:
    """An `EmbeddedEngine` over its own copy of the policy; serves request chunks."""

    def __init__(self, recipe_json: str, index: int) -> None:
        from diffusion_rollout import EmbeddedEngine

        self.recipe = _recipe(recipe_json)
        self.index = index
        _threads(self.recipe)
        self.adapter = load_policy(self.recipe)
        self.adapter.set_trainable("frozen")
        self.denoiser = _SyncTarget(self.adapter)
        self.engine = EmbeddedEngine(self.denoiser, max_num_seqs=self.recipe.rollout.max_num_seqs)
        self.asleep = False
        self.timeline: list[tuple[str, float, float]] = []

    def ready(self) -> int:
        return self.engine.version

    def generate(self, requests_json: str, tag: str = "") -> dict[str, Any]:
        """Roll out a chunk: `{"trajectories": [bytes], "forwards": n, "rows": m}` (the
        engine's forward count and packed rows for this chunk)."""
        from diffusion_rollout import RolloutRequest
        from diffusion_rollout.wire import trajectory_to_bytes

        if self.asleep:
            raise RuntimeError(f"rollout worker {self.index} is asleep; wake() it first")
        t0 = time.time()
        reqs = [RolloutRequest.from_dict(d) for d in json.loads(requests_json)]
        before = self.engine.stats()
        trajs = self.engine.generate_many(reqs)
        after = self.engine.stats()
        out = [trajectory_to_bytes(t) for t in trajs]
        self.timeline.append((tag, t0, time.time()))
        return {
            "trajectories": out,
            "forwards": int(after["forwards"] - before["forwards"]),
            "rows": int(after["rows"] - before["rows"]),
        }

    def update_weights(self, payload: bytes, version: int) -> str:
        """Load a weight version (LoRA tensors, or every weight when the blob says `full`);
        returns the checksum of what was loaded. Re-sending the current version reloads it."""
        from diffusion_rollout.wire import tensors_from_bytes
        from omni_adapters import weights_checksum

        tensors, meta = tensors_from_bytes(payload)
        self.denoiser.full = bool(json.loads(meta.get("full", "false")))
        if version == self.engine.version:
            with torch.no_grad():
                self.denoiser.load_weights(tensors)
        else:
            self.engine.update_weights(tensors, version=version)
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
    """The recipe's reward; scores image chunks."""

    def __init__(self, recipe_json: str, index: int) -> None:
        from ..trainer import build_reward

        self.recipe = _recipe(recipe_json)
        self.index = index
        _threads(self.recipe)
        self.reward = build_reward(self.recipe)

    def ready(self) -> bool:
        return True

    def score(self, images: bytes, prompts_json: str) -> bytes:
        from diffusion_rollout.wire import tensors_from_bytes, tensors_to_bytes
        from omni_rewards import RewardInput

        tensors, _ = tensors_from_bytes(images)
        out = self.reward(
            RewardInput(images=tensors["images"].numpy(), prompts=json.loads(prompts_json))
        )
        res = {"scores": torch.as_tensor(np.asarray(out.scores, dtype=np.float64))}
        for k, v in (out.details or {}).items():
            arr = np.asarray(v)
            if arr.ndim == 1 and np.issubdtype(arr.dtype, np.number):
                res["details." + k] = torch.as_tensor(arr.astype(np.float64))
        return tensors_to_bytes(res)


# ---------------------------------------------------------------------------------------------
# pools with restart + resubmit


def _dead(exc: BaseException) -> bool:
    import ray

    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


class WorkerPool:
    """Ray actors of one role. `call_all` fans work out and restarts dead actors.

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


class PendingRollout:
    """A submitted rollout: `result()` decodes the trajectories and checks count and order."""

    def __init__(self, pending: Pending, ranges: list[range], requests: list[Any]) -> None:
        self.pending, self.ranges, self.requests = pending, ranges, requests
        self.forwards = self.rows = 0
        self.on_done: Callable[[int, int], None] | None = None

    def result(self) -> list[Any]:
        from diffusion_rollout.wire import trajectory_from_bytes

        out = []
        parts = self.pending.result()
        self.forwards = sum(p["forwards"] for p in parts)
        self.rows = sum(p["rows"] for p in parts)
        if self.on_done is not None:
            self.on_done(self.forwards, self.rows)
        for rg, part in zip(self.ranges, parts):
            blobs = part["trajectories"]
            if len(blobs) != len(rg):
                raise TrainError(f"rollout: a worker returned {len(blobs)} of {len(rg)} samples")
            out.extend(trajectory_from_bytes(b) for b in blobs)
        for req, t in zip(self.requests, out):
            if t.request_id != req.request_id:
                raise TrainError(f"rollout: result {t.request_id} out of order ({req.request_id})")
        if len(out) != len(self.requests):
            raise TrainError(f"rollout: {len(out)} trajectories for {len(self.requests)} requests")
        return out


class RemoteEngine:
    """Stands in for `EmbeddedEngine` on the driver: `generate_many` splits the requests over
    the rollout pool (order kept), `update_weights` pushes a version to every rollout actor."""

    def __init__(self, recipe_json: str, resources: dict[str, float], max_restarts: int) -> None:
        self.version = 0
        self._weights: bytes | None = None
        self._sync: Pending | None = None
        self._forwards = self._rows = 0
        self.defer = False
        self.deferred: PendingRollout | None = None
        self.pool = WorkerPool(
            "rollout",
            RolloutWorker,
            lambda i: (recipe_json, i),
            int(resources["workers"]),
            resources,
            max_restarts,
            on_restart=self._bring_up,
        )
        import ray

        ray.get([h.ready.remote() for h in self.pool.handles])

    def _bring_up(self, i: int) -> None:
        import ray

        if self._weights is not None:
            ray.get(self.pool.handles[i].update_weights.remote(self._weights, self.version))

    def _chunks(self, requests: list[Any], tag: str) -> tuple[list[range], list[tuple[int, tuple]]]:
        ranges = _split(len(requests), len(self.pool))
        chunks = [
            (w, (json.dumps([requests[i].to_dict() for i in rg]), tag))
            for w, rg in enumerate(ranges)
        ]
        return ranges, chunks

    def submit_many(self, requests: list[Any], tag: str = "") -> PendingRollout:
        """Start a rollout without waiting; `.result()` gives the trajectories in order."""
        if self._sync is not None:  # surface a failed weight push before new work
            pending, self._sync = self._sync, None
            pending.result()
        requests = list(requests)
        if not tag and requests:
            tag = str(requests[0].request_id).split("-")[0]
        ranges, chunks = self._chunks(requests, tag)
        handle = PendingRollout(self.pool.submit("generate", chunks), ranges, requests)
        handle.on_done = self._count
        return handle

    def _count(self, forwards: int, rows: int) -> None:
        self._forwards += forwards
        self._rows += rows

    def generate_many(self, requests: list[Any], tag: str = "") -> list[Any]:
        """Blocking rollout. With `defer` set (async mode) it only submits: the handle goes
        to `self.deferred` and an empty list comes back."""
        handle = self.submit_many(requests, tag)
        if self.defer:
            self.deferred = handle
            return []
        return handle.result()

    def update_weights(
        self, tensors: dict[str, torch.Tensor] | bytes, version: int, wait: bool = True
    ) -> None:
        """Push a weight version to every rollout actor (in each actor's queue order, so work
        submitted afterwards runs on it). `wait=False` returns at once (async mode)."""
        from diffusion_rollout.wire import tensors_to_bytes

        payload = tensors if isinstance(tensors, bytes) else tensors_to_bytes(tensors)
        self._weights, self.version = payload, version
        pending = self.pool.submit(
            "update_weights", [(i, (payload, version)) for i in range(len(self.pool))]
        )
        if wait:
            pending.result()
        else:
            self._sync = pending

    def sleep(self) -> None:
        self.pool.call_all("sleep", [(i, ()) for i in range(len(self.pool))])

    def wake(self) -> None:
        self.pool.call_all("wake", [(i, ()) for i in range(len(self.pool))])

    def timelines(self) -> list[tuple[str, float, float]]:
        import ray

        return [e for h in self.pool.handles for e in ray.get(h.get_timeline.remote())]

    def stats(self) -> dict[str, Any]:
        """Driver-side totals (no call to the workers, so it never waits on queued work):
        `forwards` and `rows` over the collected rollouts, like `EmbeddedEngine.stats()`."""
        return {
            "workers": len(self.pool),
            "restarts": self.pool.restarts,
            "version": self.version,
            "forwards": self._forwards,
            "rows": self._rows,
        }

    def close(self) -> None:
        self.pool.close()


class RemoteReward:
    """Stands in for the reward on the driver: callable on a `RewardInput`, split over the
    reward pool; returns an `omni_rewards.RewardOutput`."""

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
        from diffusion_rollout.wire import tensors_from_bytes, tensors_to_bytes
        from omni_rewards import RewardOutput

        images = np.asarray(inp.images)
        prompts = list(inp.prompts or [""] * len(images))
        ranges = _split(len(images), len(self.pool))
        chunks = [
            (
                w,
                (
                    tensors_to_bytes({"images": torch.from_numpy(images[rg.start : rg.stop])}),
                    json.dumps(prompts[rg.start : rg.stop]),
                ),
            )
            for w, rg in enumerate(ranges)
        ]
        parts = [tensors_from_bytes(b)[0] for b in self.pool.call_all("score", chunks)]
        scores = np.concatenate([p["scores"].numpy() for p in parts]).astype(np.float32)
        if len(scores) != len(images):
            raise TrainError(f"reward: {len(scores)} scores for {len(images)} samples")
        keys = set.intersection(*[{k for k in p if k.startswith("details.")} for p in parts])
        details = {
            k.removeprefix("details."): np.concatenate([p[k].numpy() for p in parts])
            for k in sorted(keys)
        }
        return RewardOutput(scores=scores, details=details)

    def close(self) -> None:
        self.pool.close()


# ---------------------------------------------------------------------------------------------
# the driver


def ensure_ray(recipe: Recipe) -> bool:
    """Connect to the Ray cluster (`RAY_ADDRESS`) or start a local one; True if started here."""
    import os

    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], include_dashboard=False)
    else:
        ray.init(
            num_cpus=max(2, os.cpu_count() or 2),
            num_gpus=recipe.trainer.gpus_per_node or None,
            include_dashboard=False,
            log_to_driver=False,
        )
    return True


class RayTrainer(LocalTrainer):
    """The LocalTrainer loop with the work done by Ray actor pools (see module docstring)."""

    correction: str | None = None  # set per step by the async trainer

    def __init__(self, recipe: Recipe, run_dir: str | Path | None = None) -> None:
        super().__init__(recipe, run_dir)
        self._own_ray = False
        #: sync mode with actor and rollout on the same GPUs: the rollout sleeps during updates
        self.colocated = recipe.trainer.gpus_per_node > 0 and recipe.trainer.mode == "sync"
        self.actors: list[Any] = []
        self.engine: Any = None
        self.reward: Any = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        import ray

        from ..data import PromptData

        r = self.recipe
        if getattr(r.optimizer, "ema_decay", 0.0) > 0:
            raise TrainError(
                "optimizer.ema_decay: EMA weights are not supported by backend ray yet"
            )
        self.ema = False
        self.loss_fn = _loss_fn(r)
        path = ensure_model(r)  # build the tiny model once, before the workers look for it
        from omni_adapters import adapter_for, read_architecture

        if getattr(adapter_for(read_architecture(path)), "needs_images", False):
            raise TrainError(
                f"model.path: {path} is image-conditioned (source image per request); "
                "trainer.backend ray does not send images to its rollout workers yet, use "
                "trainer.backend local"
            )
        self.params = r.sampling_params()
        self.data = PromptData.from_config(r.data, r.trainer.seed)
        sizes = pool_sizes(r)
        batch = r.data.prompts_per_step * r.rollout.n
        mb = batch // r.algorithm.num_minibatches
        if mb < sizes["actor"]["workers"]:
            raise TrainError(
                f"trainer.num_workers: {sizes['actor']['workers']} actor workers but a minibatch "
                f"has only {mb} rows"
            )
        self._own_ray = ensure_ray(r)
        rj = r.model_dump_json()
        world = int(sizes["actor"]["workers"])
        cls = ray.remote(ActorWorker)
        self.actors = [
            cls.options(
                num_cpus=sizes["actor"]["cpus_per_worker"],
                num_gpus=sizes["actor"]["gpus_per_worker"],
            ).remote(rj, rank, world)
            for rank in range(world)
        ]
        addr, port = ray.get(self.actors[0].address.remote())
        ray.get([a.setup.remote(addr, port) for a in self.actors])
        self.engine = RemoteEngine(rj, sizes["rollout"], r.trainer.max_restarts)
        self.reward = RemoteReward(rj, sizes["reward"], r.trainer.max_restarts)
        self.params_named = {}
        self.lora_modules = 0
        self.sync_weights(0)
        self._setup_done = True

    def close(self) -> None:
        import ray

        for part in (self.engine, self.reward):
            if part is not None:
                part.close()
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.actors = []
        if self._own_ray:
            ray.shutdown()
            self._own_ray = False

    def train(self, resume_from: str | Path | None = None) -> list[dict[str, Any]]:
        if resume_from is not None:
            raise TrainError("resume: backend ray resumes weights only via backend local for now")
        try:
            return super().train()
        finally:
            self.close()

    # ------------------------------------------------------------------ update
    def plan_update(self, batch: StepBatch, step: int) -> tuple[torch.Tensor, list[Any]]:
        """Advantages (the full batch, as the local update) and each rank's `ShardPlan`."""
        from omni_algos.advantages import group_advantages

        from ..seeds import DOMAIN_MINIBATCH, derive_seed
        from .fsdp import make_shard_plan

        r = self.recipe
        a = r.algorithm
        rewards = torch.as_tensor(batch.rewards, dtype=torch.float32)
        adv = group_advantages(rewards, torch.as_tensor(batch.group_ids), std=a.adv_std)
        adv = adv.clamp(-a.adv_clip_max, a.adv_clip_max)
        B = len(batch.trajectories)
        perms = []
        for epoch in range(a.epochs):
            g = torch.Generator().manual_seed(
                derive_seed(r.trainer.seed, step, epoch, DOMAIN_MINIBATCH)
            )
            perms.append(
                torch.randperm(B, generator=g) if a.num_minibatches > 1 else torch.arange(B)
            )
        return adv, make_shard_plan(perms, a.num_minibatches, len(self.actors))

    def update_refs(self, batch: StepBatch, step: int) -> tuple[list[Any], torch.Tensor]:
        """Submit the update to the actor pool without waiting (the async mode overlaps it)."""
        from diffusion_rollout.wire import tensors_to_bytes

        adv, plans = self.plan_update(batch, step)
        refs = []
        for actor, plan in zip(self.actors, plans):
            data = _batch_tensors(batch.trajectories, plan.rows, adv)
            meta = {
                "plan": json.dumps(
                    {"rows": plan.rows, "steps": plan.steps, "minibatch_size": plan.minibatch_size}
                )
            }
            refs.append(actor.update.remote(tensors_to_bytes(data, meta), step, self.correction))
        return refs, adv

    def update(self, batch: StepBatch, step: int) -> dict[str, float]:
        import ray

        if self.colocated:  # actor and rollout share GPUs: free the rollout's memory
            self.engine.sleep()
        refs, adv = self.update_refs(batch, step)
        try:
            results = ray.get(refs)
        except Exception as exc:
            from ..errors import NonFiniteError

            cause = getattr(exc, "cause", None)
            if isinstance(cause, NonFiniteError):
                path = self.save_bad_samples(batch, step, batch.rewards, "loss")
                raise NonFiniteError(f"{cause}; samples saved to {path}") from None
            raise
        metrics = dict(results[0])
        metrics["actor/adv_abs_mean"] = float(adv.abs().mean())
        return metrics

    # ------------------------------------------------------------------ sync
    def gather_weights(self, full: bool = False, fmt: str = "omni") -> bytes:
        import ray

        return ray.get([a.export_weights.remote(full, fmt) for a in self.actors])[0]

    def sync_weights(self, version: int, full: bool = False) -> None:
        """Actor -> rollout with a version: LoRA tensors (fast path) or every weight."""
        payload = self.gather_weights(full)
        if self.colocated:
            self.engine.wake()
        self.engine.update_weights(payload, version)
        self.version = version

    def trainable_tensors(self) -> dict[str, torch.Tensor]:
        import ray

        from diffusion_rollout.wire import tensors_from_bytes

        blob = ray.get([a.trainable_state.remote() for a in self.actors])[0]
        return tensors_from_bytes(blob)[0]

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> Path:
        """Gathered trainable weights + LoRA export. The sharded AdamW moments are not saved
        (a resumed ray run restarts them)."""
        import ray
        from safetensors.torch import save as st_save

        from diffusion_rollout.wire import tensors_from_bytes

        from ..checkpoint import save_checkpoint

        lora_tensors = lora_cfg = None
        extra: dict[str, bytes] = {}
        if self.recipe.lora.enabled:
            lora_tensors = tensors_from_bytes(self.gather_weights(fmt="peft"))[0]
            lora_cfg = json.loads(ray.get(self.actors[0].lora_config.remote()))
            # same layout as LocalTrainer.save: diffusers reads rank/alpha/targets from metadata
            meta = {f"transformer.{k}": v for k, v in lora_cfg.items()}
            extra["pytorch_lora_weights.safetensors"] = st_save(
                {
                    "transformer." + k.removeprefix("base_model.model."): v
                    for k, v in lora_tensors.items()
                },
                metadata={
                    "format": "pt",
                    "lora_adapter_metadata": json.dumps(meta, sort_keys=True),
                },
            )
        return save_checkpoint(
            self.run_dir / "checkpoint",
            step,
            self.trainable_tensors(),
            None,
            state={"version": self.version, "experiment": self.recipe.experiment, "backend": "ray"},
            lora_tensors=lora_tensors,
            lora_config=lora_cfg,
            lora_files=extra,
            keep=self.recipe.trainer.keep_checkpoints,
        )

    def restore(self, path: str | Path) -> int:
        raise TrainError("resume: backend ray cannot restore sharded optimizer state yet")

    def timelines(self) -> dict[str, list[tuple[str, float, float]]]:
        """(tag, start, end) wall-clock intervals per role (for the overlap checks)."""
        import ray

        actor = [e for a in self.actors for e in ray.get(a.get_timeline.remote())]
        return {"actor": actor, "rollout": self.engine.timelines()}


def train_ray(recipe: Recipe, run_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Entry point for `trainer.backend: ray` (sync or async mode)."""
    if recipe.trainer.mode == "async":
        from .async_mode import AsyncRayTrainer

        return AsyncRayTrainer(recipe, run_dir).train()
    return RayTrainer(recipe, run_dir).train()
