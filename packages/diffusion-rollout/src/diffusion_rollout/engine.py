"""`EmbeddedEngine`: request-level batching of diffusion rollouts in one process.

Requests whose ``params.compat_key()`` agree are packed into one ``denoiser.velocity`` call
(a *wave*) of up to ``max_num_seqs`` rows. Every random draw of a request comes from its own
``torch.Generator("cpu").manual_seed(seed)``, in this order (docs/interfaces.md):

1. the SDE window start (``omni_algos.sde.sample_windows``),
2. the initial latents (``denoiser.init_latents(..., generators=[g, ...])``, one row per g),
3. the SDE noise of each window step, in step order (``omni_algos.sde.step`` with one
   generator per row). Steps outside a row's window are ODE steps
   ``x_next = x + (sigma_next - sigma) v`` and draw nothing.

So a request's trajectory does not depend on which requests shared its waves, nor on their
order: only the transformer's batched kernels can differ, by float rounding (measured in the
tests and the benchmark).

Which thread computes. A caller that blocks anyway (`generate_many`) runs the waves in its
own thread: the process then keeps one OpenMP thread team. Two threads that have both run
torch ops hold two teams, and with more OpenMP threads than cores libgomp stops spin-waiting,
so every small op sleeps and wakes (the trainer's update in the main thread and the waves in
a scheduler thread took 0.50 s per step instead of 0.22 s; docs/performance.md). Only the
non-blocking calls (`submit`, `submit_many`, `generate`, `agenerate_many`: the HTTP server)
start a scheduler thread, so the asyncio loop of a caller stays free while a wave computes;
that thread runs torch with ``threads`` threads (the creator's count by default). One thread
at a time drives the waves (the *driver*); a blocking caller that finds the scheduler thread
already driving waits for its futures instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .lora import LoraSpec, ensure_lora
from .params import RolloutRequest
from .types import (
    Denoiser,
    EngineClosed,
    RequestAborted,
    Trajectory,
    VersionMismatchError,
)
from .wave import check_images, denoise_wave
from .weights import check_weights, weight_shapes

__all__ = ["EmbeddedEngine"]


@dataclass
class _Entry:
    request: RolloutRequest
    future: concurrent.futures.Future
    key: tuple
    version: int | None
    t_submit: float
    stop: bool = False  # set by cancel/abort while the request's wave runs
    differentiable: bool = False  # generate_many(differentiable=True): keep the SDE graph


@dataclass
class _Stats:
    waves: int = 0
    requests: int = 0
    forwards: int = 0
    rows: int = 0
    queue_wait_s: float = 0.0
    step_s: float = 0.0
    wave_s: float = 0.0
    failed: int = 0
    aborted: int = 0
    version_errors: int = 0


def _sched_key(request: RolloutRequest) -> tuple:
    # compat_key without its weights_version slot: requests pinned to the current version and
    # requests that take any version run on the same weights, so they may share a wave.
    # Requests with and without a condition image never share a wave (only one of them can
    # suit the denoiser; that one runs, the other fails alone); nor do requests with different
    # numbers of condition images (their conditions do not stack).
    return (*request.params.compat_key()[:-1], request.num_images)


class EmbeddedEngine:
    """Request-batched rollout engine around a `Denoiser`.

    Args:
        denoiser: any object with the `Denoiser` methods.
        max_num_seqs: the most requests packed into one forward (rows; guidance doubles the
            rows the transformer itself sees, see the README).
        max_wait_ms: how long the oldest waiting request may wait for more compatible
            requests to arrive before a wave below ``max_num_seqs`` starts (0: start at once).
        version: the weights version the denoiser starts with.
        version_timeout_s: how long a request pinned to a version the engine does not have
            yet waits for `update_weights` before it fails with `VersionMismatchError`.
        max_wave_pixels: the most pixels (height x width x frames, summed over rows) one
            wave may hold; a wave of large requests gets fewer rows (at least one). None: no
            bound beyond ``max_num_seqs``.
        threads: the torch threads of the scheduler thread (default: the creator's count).
        grad_denoiser: for ``generate_many(differentiable=True)``: the denoiser the forwards
            with autograd run on (`diffusion_rollout.wave`), e.g. a trainer's unmerged LoRA
            policy while ``denoiser`` is its merged copy; default ``denoiser``. Weight updates
            load into ``denoiser`` only: the caller keeps the two in step.

    Example:
        >>> engine = EmbeddedEngine(denoiser, max_num_seqs=16)
        >>> trajs = engine.generate_many([RolloutRequest("a cat", seed=i, params=p) for i in range(32)])
    """

    def __init__(
        self,
        denoiser: Denoiser,
        max_num_seqs: int = 16,
        max_wait_ms: float = 0,
        *,
        version: int = 0,
        version_timeout_s: float = 60.0,
        max_wave_pixels: int | None = None,
        threads: int | None = None,
        grad_denoiser: Denoiser | None = None,
    ) -> None:
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
        ):
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if version_timeout_s < 0:
            raise ValueError(f"version_timeout_s must be >= 0, got {version_timeout_s}")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an integer >= 0, got {version!r}")
        if max_wave_pixels is not None and (
            isinstance(max_wave_pixels, bool)
            or not isinstance(max_wave_pixels, int)
            or max_wave_pixels < 1
        ):
            raise ValueError(f"max_wave_pixels must be an integer >= 1, got {max_wave_pixels!r}")
        for name in ("encode", "init_latents", "sigmas", "velocity"):
            if not callable(getattr(denoiser, name, None)):
                raise TypeError(f"denoiser has no method {name!r} (see diffusion_rollout.Denoiser)")
        self.denoiser = denoiser
        # generate_many(differentiable=True): the denoiser its autograd forwards run on
        self.grad_denoiser = grad_denoiser
        self.max_num_seqs = max_num_seqs
        self.max_wait_s = float(max_wait_ms) / 1000.0
        self.version_timeout_s = float(version_timeout_s)
        self.max_wave_pixels = max_wave_pixels
        # the scheduler thread's torch threads: the creator's, so a process that set a budget
        # (trainer.threads, torch.set_num_threads) keeps it in that thread too
        self.threads = threads if threads is not None else torch.get_num_threads()
        self._version = version
        self._driver: threading.Thread | None = None  # the thread running waves now
        self._queue: list[_Entry] = []
        self._cond = threading.Condition()
        self._compute_lock = threading.Lock()
        self._updates_waiting = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._stats = _Stats()
        self._weight_shapes: dict[str, tuple[int, ...]] = {}
        self._running: list[_Entry] = []

    # ----------------------------------------------------------------- public API
    @property
    def version(self) -> int:
        """The weights version the next wave runs on."""
        return self._version

    def submit(self, request: RolloutRequest) -> concurrent.futures.Future:
        """Queue one request; returns a `concurrent.futures.Future` of its `Trajectory`."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: Iterable[RolloutRequest]) -> list[concurrent.futures.Future]:
        """Queue many requests at once (they can all join the first wave); the scheduler
        thread runs them."""
        return self._enqueue(requests, start_thread=True)

    def _enqueue(
        self,
        requests: Iterable[RolloutRequest],
        *,
        start_thread: bool,
        differentiable: bool = False,
    ) -> list[concurrent.futures.Future]:
        entries = []
        now = time.monotonic()
        for i, req in enumerate(requests):
            if not isinstance(req, RolloutRequest):
                raise TypeError(f"requests[{i}] is a {type(req).__name__}, not a RolloutRequest")
            check_images(self.denoiser, [req], f"requests[{i}]")
            if not req.request_id:
                req = dataclasses.replace(req, request_id=f"req-{next(self._ids)}")
            entries.append(
                _Entry(
                    req,
                    concurrent.futures.Future(),
                    (*_sched_key(req), differentiable),
                    req.params.weights_version,
                    now,
                    differentiable=differentiable,
                )
            )
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._queue.extend(entries)
            if start_thread:
                self._ensure_thread()
            self._cond.notify_all()
        return [e.future for e in entries]

    async def generate(self, request: RolloutRequest) -> Trajectory:
        """Roll out one request; waits for its wave."""
        return await asyncio.wrap_future(self.submit(request))

    async def agenerate_many(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        """Roll out many requests; trajectories in request order."""
        futs = self.submit_many(requests)
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futs)))

    def generate_many(
        self,
        requests: Sequence[RolloutRequest],
        *,
        progress: bool = False,
        on_ready: Callable[[list[int], list[Trajectory]], None] | None = None,
        differentiable: bool = False,
    ) -> list[Trajectory]:
        """Blocking: roll out many requests, trajectories in request order.

        The waves run in the calling thread (module docstring: one OpenMP team), so this
        needs no event loop and starts no thread. ``on_ready(indices, trajectories)`` is
        called in this thread after each wave with the requests it finished (their indices
        in ``requests``), before the next wave starts: the caller can hand them to a reward
        thread meanwhile. The first failed request's error is raised after all finished.

        ``differentiable``: the trajectories' ``log_probs`` keep the autograd graph of their
        SDE steps (`diffusion_rollout.wave`), for a trainer that back-propagates through
        this rollout's forwards; these requests share waves only with each other. Their
        activations stay in memory as long as the trajectories do.
        """
        futs = self._enqueue(requests, start_thread=False, differentiable=differentiable)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(futs), desc="rollout", unit="req")
        pending = set(range(len(futs)))

        def report() -> None:
            ready = sorted(i for i in pending if futs[i].done())
            pending.difference_update(ready)
            if bar is not None:
                bar.update(len(ready))
            good = [i for i in ready if not futs[i].cancelled() and futs[i].exception() is None]
            if on_ready is not None and good:
                on_ready(good, [futs[i].result() for i in good])

        for f in futs:  # wakes this thread when a future ends elsewhere (abort, close)
            f.add_done_callback(self._wake)
        try:
            self._drive(lambda: all(f.done() for f in futs), after_wave=report)
            concurrent.futures.wait(futs)  # futures another driver (the scheduler) runs
            report()
        finally:
            if bar is not None:
                bar.close()
        return [f.result() for f in futs]

    def _wake(self, _: object = None) -> None:
        with self._cond:
            self._cond.notify_all()

    def update_weights(
        self,
        tensors: dict[str, Tensor],
        version: int,
        *,
        lora: LoraSpec | dict[str, Any] | None = None,
    ) -> None:
        """Load new trainable weights as ``version``, atomically.

        Every tensor is checked first (`diffusion_rollout.weights.check_weights`: names,
        floating dtype, finite values, the shapes of earlier updates); a rejected update
        raises `WeightsRejected` (a ValueError naming the tensor) and changes nothing.
        A wave in flight finishes on the old weights; no new wave starts until the load is
        done; requests pinned to ``version`` that were waiting run next. Versions only go up.
        ``lora`` (a `LoraSpec` or its dict): the LoRA adapter these tensors need; added to the
        denoiser first if it has none (`diffusion_rollout.lora.ensure_lora`, between waves).
        LoRA tensors for a denoiser without an adapter and without ``lora`` are a ValueError
        naming ``lora_config``.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"update_weights: version must be an integer >= 0, got {version!r}")
        # All or nothing: every tensor is checked (name, dtype, finite, shape against earlier
        # updates) before the denoiser sees any; a rejected update keeps weights and version.
        tensors = check_weights(tensors, self._weight_shapes)
        load = getattr(self.denoiser, "load_weights", None)
        if not callable(load):
            raise TypeError("update_weights: the denoiser has no load_weights(tensors) method")
        with self._cond:
            self._updates_waiting += 1
        try:
            with self._compute_lock:
                if version <= self._version:
                    raise ValueError(
                        f"update_weights: version {version} is not newer than the engine's "
                        f"version {self._version}"
                    )
                ensure_lora(self.denoiser, lora, tensors)
                with torch.no_grad():
                    load(tensors)
                with self._cond:
                    self._version = version
                    self._weight_shapes.update(weight_shapes(tensors))
        finally:
            with self._cond:
                self._updates_waiting -= 1
                self._cond.notify_all()

    def abort(self, request_id: str) -> int:
        """Abort the requests with this id; returns how many. Queued ones leave the queue at
        once; running ones stop at their wave's next step boundary and free their rows. Their
        futures raise `RequestAborted` (a client may retry them)."""
        return self._stop(lambda e: e.request.request_id == request_id)

    def cancel(self, future: concurrent.futures.Future) -> bool:
        """Abort the one request whose future `submit` returned (see `abort`); True when it
        was still queued or running. The HTTP server calls this when a client goes away or
        its request passes the deadline."""
        return self._stop(lambda e: e.future is future) > 0

    def _stop(self, match: Any) -> int:
        with self._cond:
            hit = [e for e in self._queue if match(e)]
            self._queue = [e for e in self._queue if not match(e)]
            running = [e for e in self._running if match(e) and not e.stop]
            for e in running:
                e.stop = True
            self._stats.aborted += len(hit) + len(running)
        for e in hit:
            e.future.set_exception(RequestAborted(f"request {e.request.request_id!r} was aborted"))
        return len(hit) + len(running)

    def stats(self) -> dict[str, Any]:
        """Waves run, mean rows per forward, mean queue wait, mean time per denoising step."""
        with self._cond:
            s = self._stats
            return {
                "waves": s.waves,
                "requests": s.requests,
                "forwards": s.forwards,
                "rows": s.rows,
                "mean_rows_per_forward": s.rows / s.forwards if s.forwards else 0.0,
                "mean_queue_wait_s": s.queue_wait_s / s.requests if s.requests else 0.0,
                "mean_step_s": s.step_s / s.forwards if s.forwards else 0.0,
                "wave_s": s.wave_s,
                "failed": s.failed,
                "aborted": s.aborted,
                "version_errors": s.version_errors,
                "pending": len(self._queue),
                "version": self._version,
                "max_num_seqs": self.max_num_seqs,
                "max_wave_pixels": self.max_wave_pixels,
                "max_wait_ms": self.max_wait_s * 1000.0,
            }

    def close(self) -> None:
        """Abort the queued requests (`EngineClosed`), let a wave in flight finish, stop."""
        with self._cond:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cond.notify_all()
            thread = self._thread
        for e in pending:
            e.future.set_exception(EngineClosed("the engine was closed before this request ran"))
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- scheduler
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="diffusion-rollout-scheduler", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        torch.set_num_threads(self.threads)  # this thread's own OpenMP count (per thread)
        self._drive(lambda: False)

    def _drive(
        self, done: Callable[[], bool], after_wave: Callable[[], None] | None = None
    ) -> None:
        """Run waves in this thread until ``done()`` or the engine closes. Only one thread
        drives at a time; another one waits here until the driver leaves or ``done()``."""
        me = threading.current_thread()
        try:
            while True:
                with self._cond:
                    while self._driver is not None and self._driver is not me:
                        if self._closed or done():
                            return
                        self._cond.wait()
                    self._driver = me
                    wave = self._next_wave_locked(done)
                if wave is None:
                    return
                self._run_wave(wave)
                if after_wave is not None:
                    after_wave()
        finally:  # also when a wave or after_wave raised: never leave the role held
            with self._cond:
                if self._driver is me:
                    self._driver = None
                    self._cond.notify_all()  # a waiting caller may drive now

    def _expire_locked(self, now: float) -> None:
        keep = []
        for e in self._queue:
            if e.future.cancelled():
                continue
            v = e.version
            if v is not None and v < self._version:
                self._stats.version_errors += 1
                e.future.set_exception(
                    VersionMismatchError(
                        f"request {e.request.request_id!r} asks for weights version {v}, but "
                        f"the engine is at version {self._version} (old weights are not kept)"
                    )
                )
            elif v is not None and v > self._version and now - e.t_submit > self.version_timeout_s:
                self._stats.version_errors += 1
                e.future.set_exception(
                    VersionMismatchError(
                        f"request {e.request.request_id!r} asks for weights version {v}; the "
                        f"engine is at version {self._version} and no update_weights brought "
                        f"version {v} within {self.version_timeout_s:g} s"
                    )
                )
            else:
                keep.append(e)
        self._queue = keep

    def _next_wave_locked(self, done: Callable[[], bool]) -> list[_Entry] | None:
        while True:
            if self._closed or done():
                return None
            if self._updates_waiting:
                self._cond.wait()
                continue
            now = time.monotonic()
            self._expire_locked(now)
            cur = self._version
            runnable = [e for e in self._queue if e.version is None or e.version == cur]
            if runnable:
                key = runnable[0].key
                rows = self._wave_rows(runnable[0].request)
                group = [e for e in runnable if e.key == key][:rows]
                if len(group) < rows and self.max_wait_s > 0:
                    wait_until = group[0].t_submit + self.max_wait_s
                    if now < wait_until:
                        self._cond.wait(wait_until - now)
                        continue
                chosen = {id(e) for e in group}
                self._queue = [e for e in self._queue if id(e) not in chosen]
                claimed = [e for e in group if e.future.set_running_or_notify_cancel()]
                if claimed:
                    self._running = claimed  # cancel() finds them from here on
                    return claimed
                continue
            waiting = [e.t_submit + self.version_timeout_s for e in self._queue]
            timeout = max(min(waiting) - now, 0.0) + 1e-3 if waiting else None
            self._cond.wait(timeout)

    def _wave_rows(self, request: RolloutRequest) -> int:
        """Rows a wave of requests like this one may hold: ``max_num_seqs``, fewer when
        ``max_wave_pixels`` allows fewer (never below one)."""
        if self.max_wave_pixels is None:
            return self.max_num_seqs
        p = request.params
        per_row = p.height * p.width * p.num_frames
        return max(1, min(self.max_num_seqs, self.max_wave_pixels // per_row))

    def _run_wave(self, entries: list[_Entry]) -> None:
        with self._compute_lock:
            t_start = time.monotonic()
            version = self._version
            ok: list[_Entry] = []
            for e in entries:
                if e.version is not None and e.version != version:
                    with self._cond:
                        self._stats.version_errors += 1
                    e.future.set_exception(
                        VersionMismatchError(
                            f"request {e.request.request_id!r} asks for weights version "
                            f"{e.version}; the engine moved to version {version} first"
                        )
                    )
                else:
                    ok.append(e)
            with self._cond:
                self._running = ok
            if not ok:
                return
            try:
                with torch.no_grad():
                    trajs, forwards, step_s = denoise_wave(
                        self.denoiser,
                        [e.request for e in ok],
                        version=version,
                        t_start=t_start,
                        t_submit=[e.t_submit for e in ok],
                        cancelled=lambda i: ok[i].stop,
                        differentiable=ok[0].differentiable,
                        grad_denoiser=self.grad_denoiser,
                    )
            except BaseException as exc:  # the wave fails, the engine keeps serving
                with self._cond:
                    self._stats.failed += len(ok)
                    self._running = []
                for e in ok:
                    e.future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            t_end = time.monotonic()
            with self._cond:
                self._running = []
                s = self._stats
                s.waves += 1
                s.requests += sum(t is not None for t in trajs)
                s.forwards += forwards
                s.rows += forwards * len(ok)
                s.queue_wait_s += sum(t_start - e.t_submit for e in ok)
                s.step_s += step_s
                s.wave_s += t_end - t_start
        for e, traj in zip(ok, trajs):
            if traj is None:  # stopped at a step boundary (cancel / abort)
                e.future.set_exception(
                    RequestAborted(f"request {e.request.request_id!r} was aborted while running")
                )
            else:
                e.future.set_result(traj)
