"""When each step's rollout runs: now (`trainer.mode: sync`) or ahead of time (`async`).

Both wrap any diffusion rollout port (`generate_many` / `update_weights` / `stats`: the
embedded engine, the Ray pool, an HTTP client) and give the loop one interface:
``collect(step)`` returns step's trajectories, ``push_weights(tensors, version)`` hands the
rollout a new policy.

Versions: the policy after the update of step k is version k + 1, so step j is trained by
version j. `PrefetchRollout` launches the rollout of step j as soon as

    j - (current policy version) <= max_staleness,

so every sample's staleness (version at update minus the version it was sampled with) is at
most `trainer.max_staleness` (0 is the synchronous schedule). With staleness 1 the rollout of
step k+1 (on version k) runs while step k updates. A new version is loaded only after the
rollouts in flight have finished, so a rollout never mixes two versions. Stale samples are
off-policy: the loop weights them with `trainer.async_correction` (`omni_algos.correction`).

Resume: the rollout of step j is launched on version max(0, j - max_staleness), so when a
checkpoint is written after N steps (at version N), the rollouts of steps N .. N + S - 1 run or
are about to run on versions N - S .. N - 1. `RolloutHistory` keeps those versions for the
checkpoint, and `PrefetchRollout.resume` pushes them again in order: the resumed run samples
what the uninterrupted one sampled.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TrainError

__all__ = [
    "CoreShare",
    "PrefetchRollout",
    "SyncRollout",
    "free_cores",
    "launchable",
    "staleness_stats",
    "usable_cores",
]


def launchable(next_step: int, version: int, max_staleness: int, total_steps: int) -> bool:
    """May the rollout of `next_step` start now, with the policy at `version`?"""
    return next_step < total_steps and next_step - version <= max_staleness


def staleness_stats(policy_version: int, sample_versions: list[int]) -> dict[str, float]:
    """Staleness (policy version at update minus each sample's rollout version)."""
    s = [policy_version - v for v in sample_versions]
    if any(x < 0 for x in s):
        raise TrainError(f"async: samples from a future policy version ({sample_versions})")
    return {"async/staleness_max": float(max(s)), "async/staleness_mean": sum(s) / len(s)}


def _rollout_stats(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """The engine's forward count / rows per forward between two `port.stats()` readings, and
    the seconds the rollout itself took (in async mode the loop waits less than that)."""
    forwards = after.get("forwards", 0) - before.get("forwards", 0)
    rows = after.get("rows", 0) - before.get("rows", 0)
    return {
        "rollout/forwards": float(forwards),
        "rollout/rows_per_forward": rows / max(forwards, 1),
        "timing/rollout_busy_s": seconds,
    }


def _rollout(port: Any, requests: list[Any]) -> tuple[list[Any], dict[str, float]]:
    """Roll out, and `_rollout_stats` for these requests."""
    t = time.perf_counter()
    before = port.stats()
    trajs = port.generate_many(requests)
    return trajs, _rollout_stats(before, port.stats(), time.perf_counter() - t)


class SyncRollout:
    """The rollout of step k runs when the loop asks for it.

    ``collect(step, on_ready)``: with the embedded engine (a port that can `submit_many`),
    ``on_ready(indices, trajectories)`` is called as each wave's samples finish, before the
    next waves compute (in this thread: `EmbeddedEngine.generate_many` runs the waves in its
    caller's thread), so the loop can hand them to a reward thread (the reward overlaps the
    rollout); the trajectories come back in request order either way.

    ``differentiable`` (`algorithm.reuse_rollout_forward`, the embedded engine): the
    trajectories' log-probs keep the autograd graph of their SDE steps for the update.
    ``on_does_not_fit(message)`` (its `auto` setting): when that graph would not fit the
    memory (`omni_train.updates.reuse_memory.ReuseDoesNotFit`), the step rolls out again
    without it, and so does every later step; the message goes to ``on_does_not_fit``.
    Without it the error stops the run."""

    def __init__(
        self,
        port: Any,
        requests_for: Callable[[int], list[Any]],
        version: int = 0,
        differentiable: bool = False,
        on_does_not_fit: Callable[[str], None] | None = None,
    ):
        self.port = port
        self.requests_for = requests_for
        self.version = version
        self.differentiable = differentiable
        self.reuse_chosen = differentiable
        self.on_does_not_fit = on_does_not_fit
        self.stats: dict[str, float] = {}

    def collect(
        self, step: int, on_ready: Callable[[list[int], list[Any]], None] | None = None
    ) -> list[Any]:
        requests = self.requests_for(step)
        t = time.perf_counter()
        before = self.port.stats()
        if self.differentiable:
            trajs = self._differentiable(requests, on_ready)
        elif on_ready is not None and hasattr(self.port, "submit_many"):
            # the embedded engine: its waves run in this thread, on_ready between them
            trajs = self.port.generate_many(requests, on_ready=on_ready)
        else:
            trajs = self.port.generate_many(requests)
        # the same metrics whichever way the rollout ran
        self.stats = _rollout_stats(before, self.port.stats(), time.perf_counter() - t)
        # 1: the update trains through this rollout; 0: it replays (after a fall-back too)
        if self.reuse_chosen:
            self.stats["rollout/graph_kept"] = float(self.differentiable)
        return trajs

    def _differentiable(
        self, requests: list[Any], on_ready: Callable[[list[int], list[Any]], None] | None
    ) -> list[Any]:
        from ..updates.reuse_memory import ReuseDoesNotFit

        handed = 0  # waves already handed to on_ready (their rewards are under way)

        def counted(indices: list[int], trajs: list[Any]) -> None:
            nonlocal handed
            handed += 1
            on_ready(indices, trajs)  # type: ignore[misc]

        try:
            return self.port.generate_many(
                requests, on_ready=counted if on_ready else None, differentiable=True
            )
        except ReuseDoesNotFit as exc:
            # every wave stopped at its first trained step, before on_ready; a wave that
            # finished anyway (no trained step) was scored already and cannot be taken back
            if self.on_does_not_fit is None or handed:
                raise
            exc.check.close()
            self.differentiable = False
            self.on_does_not_fit(str(exc))
        return self.port.generate_many(requests, on_ready=on_ready)

    def push_weights(self, tensors: Any, version: int) -> None:
        self.port.update_weights(tensors, version)
        self.version = version

    def close(self) -> None:
        pass


def _owned_copy(tensors: Any) -> dict[str, torch.Tensor]:
    """Rollout weights as CPU tensors that no later update changes (a learner's export can
    share storage with its parameters; an FSDP learner's pieces are put together)."""
    if hasattr(tensors, "whole"):
        tensors = tensors.whole()
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


class RolloutHistory:
    """The older rollout versions an async checkpoint holds (module docstring, Resume).

    ``saved_after(n)``: whether a checkpoint is written after n completed steps. A version v
    is kept only if such a checkpoint needs it (v < n <= v + max_staleness), as a CPU copy,
    and dropped once no later checkpoint can."""

    def __init__(self, max_staleness: int, saved_after: Callable[[int], bool]) -> None:
        self.max_staleness = max_staleness
        self.saved_after = saved_after
        self.kept: dict[int, dict[str, torch.Tensor]] = {}

    def add(self, tensors: Any, version: int) -> None:
        s = self.max_staleness
        self.kept = {v: w for v, w in self.kept.items() if v >= version - s}
        if any(self.saved_after(n) for n in range(version + 1, version + s + 1)):
            self.kept[version] = _owned_copy(tensors)

    def for_checkpoint(self, completed: int) -> dict[int, dict[str, torch.Tensor]]:
        """The versions the rollouts after `completed` steps were launched on."""
        wanted = range(max(0, completed - self.max_staleness), completed)
        return {v: self.kept[v] for v in wanted if v in self.kept}


@dataclass
class _Launched:
    future: concurrent.futures.Future
    version: int


class PrefetchRollout:
    """Rollouts launched ahead of the update, within `max_staleness` (module docstring).

    The rollouts run one at a time in one background thread, so the caller's thread stays
    free for the update. Both threads compute at once, so they split the caller's torch
    threads (``torch.get_num_threads()`` at construction, T): the rollout thread takes
    max(1, T // 2), the caller T minus that while a rollout is in flight, all T otherwise.
    The sum never exceeds T: two teams of T OpenMP threads each on T cores would stop
    libgomp's spin-waiting (see `diffusion_rollout.EmbeddedEngine`)."""

    def __init__(
        self,
        port: Any,
        requests_for: Callable[[int], list[Any]],
        *,
        max_staleness: int,
        total_steps: int,
        version: int = 0,
        next_step: int = 0,
    ) -> None:
        self.port = port
        self.requests_for = requests_for
        self.max_staleness = max_staleness
        self.total_steps = total_steps
        self.version = version
        self.next_step = next_step
        self.launched: dict[int, _Launched] = {}
        self.threads = torch.get_num_threads()
        self.rollout_threads = max(1, self.threads // 2)
        self.pool = concurrent.futures.ThreadPoolExecutor(
            1,
            thread_name_prefix="rollout-prefetch",
            initializer=torch.set_num_threads,  # per thread: the OpenMP count is thread-local
            initargs=(self.rollout_threads,),
        )
        self.stats: dict[str, float] = {}

    def _share_threads(self) -> None:
        """The caller's torch threads: what the rollout thread leaves while one is in flight."""
        in_flight = any(not item.future.done() for item in self.launched.values())
        torch.set_num_threads(
            max(1, self.threads - self.rollout_threads) if in_flight else self.threads
        )

    def _launch_ready(self) -> None:
        while launchable(self.next_step, self.version, self.max_staleness, self.total_steps):
            requests = self.requests_for(self.next_step)
            future = self.pool.submit(_rollout, self.port, requests)
            self.launched[self.next_step] = _Launched(future, self.version)
            self.next_step += 1

    def collect(self, step: int, on_ready: Any = None) -> list[Any]:
        """Step's trajectories (launched earlier; ``on_ready`` is not used: the rollout
        already ran beside the previous update)."""
        if self.next_step <= step:  # e.g. after a resume
            self.next_step = step
        self._launch_ready()
        item = self.launched.pop(step)
        trajs, stats = item.future.result()
        self._share_threads()
        self.stats = {**stats, "async/in_flight": float(len(self.launched))}
        return trajs

    def push_weights(self, tensors: Any, version: int) -> None:
        """Load `version` once the rollouts in flight are done, then launch what it allows."""
        for item in self.launched.values():
            item.future.result()
        self.port.update_weights(tensors, version)
        self.version = version
        self._launch_ready()
        self._share_threads()

    def resume(self, pushes: list[tuple[Any, int]]) -> None:
        """After a resume, with the port on the oldest version the checkpoint held: launch
        what that version allows, then make the uninterrupted run's later pushes in turn
        (``(tensors, version)``, oldest first), each launching what it allows."""
        self._launch_ready()
        for tensors, version in pushes:
            self.push_weights(tensors, version)

    def close(self) -> None:
        for item in self.launched.values():
            item.future.cancel()
        self.pool.shutdown(wait=True)
        torch.set_num_threads(self.threads)


def free_cores(load: float, own: float, cores: int) -> int:
    """Cores the other processes leave free: ``cores - max(0, load - own)``, rounded, in
    ``[1, cores]``. ``load``: the 1-minute load average (runnable threads, ours included);
    ``own``: this process's CPU seconds per second over the same stretch."""
    others = max(0.0, load - own)
    return max(1, min(cores, int(cores - others + 0.5)))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; all of them off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class CoreShare:
    """`trainer.threads: auto` on a CPU, in the synchronous loop: before each step the
    torch threads become `free_cores` of the machine (docs/performance.md).

    With more busy threads than cores, an OpenMP team's workers spin on cores that other
    processes want, and each small op waits for a worker that is not running: on 2 cores
    at load 6-9 a tiny FlowGRPO step took 120 s with 2 torch threads and 1.5 s with 1
    (`benchmarks/vs_reference_loop.py --threads 1`). On a quiet machine every core stays in.
    """

    def __init__(self) -> None:
        self.cores = usable_cores()
        self.threads = torch.get_num_threads()
        self._t = time.monotonic()
        self._cpu = time.process_time()

    def update(self) -> int:
        """Set and return this thread's torch threads for the next step."""
        t, cpu = time.monotonic(), time.process_time()
        own = (cpu - self._cpu) / max(t - self._t, 1e-3)
        self._t, self._cpu = t, cpu
        n = free_cores(os.getloadavg()[0], own, self.cores)
        if n != self.threads:
            torch.set_num_threads(n)
            self.threads = n
        return n
