"""The `Reward` base class: batching, validation, and async scoring in a worker thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from .types import RewardInput, RewardInputError, RewardOutput

__all__ = ["MissingDependencyError", "Reward", "RewardError", "RewardLike", "as_input"]


class RewardError(RuntimeError):
    """A reward could not produce a valid score (NaN, wrong length, backend failure)."""


class MissingDependencyError(ImportError):
    """An optional dependency of a reward is not installed; the message has the pip command."""


def require_module(module: str, extra: str, reward: str, *, what: str | None = None) -> Any:
    """Import ``module`` or raise `MissingDependencyError` with ``pip install 'omni-rewards[extra]'``.

    The message names ``reward 'NAME'``, or ``what`` (e.g. "omni-rewards serve") when given."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        who = what or f"reward {reward!r}"
        raise MissingDependencyError(
            f"{who} needs the python package {module.split('.')[0]!r}, "
            f"which is not installed: pip install 'omni-rewards[{extra}]'"
        ) from e


def as_input(inp: RewardInput | dict[str, Any] | None = None, **fields: Any) -> RewardInput:
    """Accept a `RewardInput`, a dict of its fields, or the fields as keyword arguments."""
    if inp is None:
        return RewardInput(**fields)
    if fields:
        raise TypeError("pass either a RewardInput or keyword fields, not both")
    if isinstance(inp, RewardInput):
        return inp
    if isinstance(inp, dict):
        unknown = set(inp) - set(RewardInput.__dataclass_fields__)
        if unknown:
            raise RewardInputError(f"unknown RewardInput fields: {sorted(unknown)}")
        return RewardInput(**inp)
    raise TypeError(f"expected a RewardInput, got {type(inp).__name__}")


@runtime_checkable
class RewardLike(Protocol):
    """What a trainer needs from a reward (third-party rewards may satisfy it structurally)."""

    def __call__(self, inp: RewardInput | None = None, /, **fields: Any) -> RewardOutput: ...

    async def ascore(self, inp: RewardInput | None = None, /, **fields: Any) -> RewardOutput: ...


class Reward:
    """Base class for rewards.

    Subclasses implement `score_batch` for at most ``batch_size`` samples; `__call__` validates
    the input, splits it into chunks of ``batch_size`` (``None`` = one chunk), checks that every
    score is finite and returns one `RewardOutput` for the whole input.

    `ascore` runs `__call__` in this reward's worker thread pool (``workers`` threads, 1 by
    default so a model is never used from two threads at once) and returns an awaitable, so a
    trainer can keep rolling out while the previous batch is scored. numpy, PIL,
    onnxruntime and torch release the GIL in their kernels, so this overlaps real work.
    """

    name: ClassVar[str] = "reward"
    #: Default chunk size; ``None`` scores the whole input at once.
    default_batch_size: ClassVar[int | None] = None

    def __init__(self, *, batch_size: int | None = None, workers: int = 1) -> None:
        bs = self.default_batch_size if batch_size is None else batch_size
        if bs is not None and int(bs) < 1:
            raise ValueError(f"batch_size: must be >= 1 or None, got {batch_size}")
        if int(workers) < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        self.batch_size: int | None = None if bs is None else int(bs)
        self.workers = int(workers)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    # ---- to implement ----

    def score_batch(self, inp: RewardInput) -> RewardOutput:  # pragma: no cover - abstract
        raise NotImplementedError

    # ---- public API ----

    def __call__(self, inp: RewardInput | dict | None = None, /, **fields: Any) -> RewardOutput:
        inp = as_input(inp, **fields)
        n = inp.batch_size
        if n == 0:
            raise RewardInputError(
                f"{self.name}: empty input (no samples in any field: images, videos, audio, "
                "latents, texts, prompts)"
            )
        step = self.batch_size or n
        outs = []
        for start in range(0, n, step):
            chunk = inp if (start == 0 and step >= n) else inp.slice(start, min(n, start + step))
            out = self.score_batch(chunk)
            if len(out) != chunk.batch_size:
                raise RewardError(
                    f"{self.name}: returned {len(out)} scores for {chunk.batch_size} samples"
                )
            outs.append(out)
        out = RewardOutput.concat(outs)
        bad = np.flatnonzero(~np.isfinite(out.scores))
        if bad.size:
            raise RewardError(
                f"{self.name}: non-finite score at sample(s) {bad[:10].tolist()} "
                f"(values {out.scores[bad[:10]].tolist()})"
            )
        return out

    async def ascore(self, inp: RewardInput | dict | None = None, /, **fields: Any) -> RewardOutput:
        """Score in this reward's worker thread; await the result."""
        inp = as_input(inp, **fields)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(self.__call__, inp))

    def submit(
        self, inp: RewardInput | dict | None = None, /, **fields: Any
    ) -> concurrent.futures.Future:
        """Thread-pool future for code that is not async."""
        inp = as_input(inp, **fields)
        return self.executor.submit(self.__call__, inp)

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.workers, thread_name_prefix=f"omni-rewards-{self.name}"
                )
            return self._executor

    def close(self) -> None:
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, batch_size={self.batch_size})"
