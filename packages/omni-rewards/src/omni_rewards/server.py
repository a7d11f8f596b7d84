"""``omni-rewards serve``: a reward behind HTTP (Starlette + uvicorn, extra ``server``).

- Binds to 127.0.0.1 unless told otherwise; optional bearer token (``Authorization: Bearer T``).
- ``POST /score`` takes the JSON of `omni_rewards.wire` and answers
  ``{"scores", "details", "batch_samples"}``; ``GET /health``; ``GET /stats``.
- Concurrent requests are coalesced: requests that arrive within ``max_wait_ms`` of each
  other and have the same fields (and latent/audio shapes) are scored as one batch of at most
  ``max_batch`` samples, then split back. If the merged batch fails, each request is scored on
  its own, so one bad request cannot fail the others.
- Errors are JSON ``{"error": "..."}`` naming the problem: 400 bad JSON / base64 / image bytes
  / shapes, 401 bad token, 413 request too large, 422 input the reward cannot score, 500 the
  reward itself failed. The server keeps serving after any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .base import Reward, require_module
from .types import RewardInput, RewardInputError, RewardOutput
from .wire import WireError, decode_input

__all__ = ["Coalescer", "create_app", "merge_inputs", "serve"]

log = logging.getLogger("omni_rewards.server")


def _compat_key(inp: RewardInput) -> tuple:
    def shape(x: Any) -> Any:
        return None if x is None else tuple(np.shape(x)[1:])

    meta = inp.metadata
    meta_key = (
        json.dumps(meta, sort_keys=True, default=str)
        if isinstance(meta, dict)
        else type(meta).__name__
    )
    return (tuple(inp.present()), inp.sample_rate, shape(inp.latents), shape(inp.audio), meta_key)


def merge_inputs(inputs: list[RewardInput]) -> RewardInput:
    """Concatenate inputs with the same `_compat_key` into one batch."""
    first = inputs[0]
    kw: dict[str, Any] = {"sample_rate": first.sample_rate}
    for name in first.present():
        parts = [getattr(i, name) for i in inputs]
        if name in ("latents", "audio"):
            kw[name] = np.concatenate([np.asarray(p) for p in parts], axis=0)
        else:
            kw[name] = [x for p in parts for x in p]
    if isinstance(first.metadata, list):
        kw["metadata"] = [m for i in inputs for m in i.metadata]
    else:
        kw["metadata"] = first.metadata
    return RewardInput(**kw)


def split_output(out: RewardOutput, sizes: list[int]) -> list[RewardOutput]:
    res, start = [], 0
    for n in sizes:
        res.append(
            RewardOutput(
                out.scores[start : start + n],
                {k: v[start : start + n] for k, v in out.details.items()},
            )
        )
        start += n
    return res


@dataclass
class _Pending:
    inp: RewardInput
    future: asyncio.Future
    key: tuple = field(default=())


class Coalescer:
    """Collects concurrent requests into batches of at most ``max_batch`` samples."""

    def __init__(self, reward: Reward, *, max_batch: int = 64, max_wait_ms: float = 5.0) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        self.reward = reward
        self.max_batch = int(max_batch)
        self.max_wait = float(max_wait_ms) / 1000.0
        self.queue: asyncio.Queue[_Pending] | None = None
        self.task: asyncio.Task | None = None
        self.stats = {
            "requests": 0,
            "samples": 0,
            "batches": 0,
            "fallbacks": 0,
            "errors": 0,
            "max_batch_seen": 0,
        }

    def _ensure_started(self) -> None:
        if self.task is None or self.task.done():
            self.queue = asyncio.Queue()
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, inp: RewardInput) -> tuple[RewardOutput, int]:
        self._ensure_started()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        assert self.queue is not None
        await self.queue.put(_Pending(inp, fut, _compat_key(inp)))
        return await fut

    async def _collect(self) -> list[_Pending]:
        assert self.queue is not None
        batch = [await self.queue.get()]
        total = batch[0].inp.batch_size
        deadline = time.monotonic() + self.max_wait
        while total < self.max_batch:
            remaining = deadline - time.monotonic()
            try:
                item = (
                    self.queue.get_nowait()
                    if remaining <= 0
                    else await asyncio.wait_for(self.queue.get(), remaining)
                )
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
            batch.append(item)
            total += item.inp.batch_size
        return batch

    async def _score(self, inp: RewardInput) -> RewardOutput:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.reward.executor, self.reward, inp)

    async def _run_group(self, group: list[_Pending]) -> None:
        sizes = [p.inp.batch_size for p in group]
        self.stats["batches"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], sum(sizes))
        try:
            merged = merge_inputs([p.inp for p in group]) if len(group) > 1 else group[0].inp
            outs = split_output(await self._score(merged), sizes)
            for p, o in zip(group, outs):
                if not p.future.done():
                    p.future.set_result((o, sum(sizes)))
            return
        except Exception as e:
            if len(group) == 1:
                self.stats["errors"] += 1
                if not group[0].future.done():
                    group[0].future.set_exception(e)
                return
        self.stats["fallbacks"] += 1
        for p in group:
            try:
                out = await self._score(p.inp)
                if not p.future.done():
                    p.future.set_result((out, p.inp.batch_size))
            except Exception as e:
                self.stats["errors"] += 1
                if not p.future.done():
                    p.future.set_exception(e)

    async def _run(self) -> None:
        while True:
            batch = await self._collect()
            groups: dict[tuple, list[_Pending]] = {}
            for p in batch:
                groups.setdefault(p.key, []).append(p)
            for group in groups.values():
                # split a group into chunks of <= max_batch samples
                chunk: list[_Pending] = []
                n = 0
                for p in group:
                    if chunk and n + p.inp.batch_size > self.max_batch:
                        await self._run_group(chunk)
                        chunk, n = [], 0
                    chunk.append(p)
                    n += p.inp.batch_size
                if chunk:
                    await self._run_group(chunk)
            for p in batch:
                self.stats["requests"] += 1
                self.stats["samples"] += p.inp.batch_size

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task


class _TooLarge(Exception):
    pass


def create_app(
    reward: Reward,
    *,
    token: str | None = None,
    max_request_bytes: int = 64 * 1024 * 1024,
    max_batch: int = 64,
    max_wait_ms: float = 5.0,
    max_samples_per_request: int = 1024,
) -> Any:
    """The Starlette app serving ``reward``."""
    require_module("starlette", "server", "serve")
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    coalescer = Coalescer(reward, max_batch=max_batch, max_wait_ms=max_wait_ms)
    expected = None if not token else f"Bearer {token}".encode()

    def error(status: int, msg: str) -> JSONResponse:
        return JSONResponse({"error": msg}, status_code=status)

    def authorised(request: Request) -> bool:
        if expected is None:
            return True
        got = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(got, expected)

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_request_bytes:
            raise _TooLarge(int(declared))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:
                raise _TooLarge(size)
            chunks.append(chunk)
        return b"".join(chunks)

    async def score(request: Request) -> JSONResponse:
        if not authorised(request):
            return error(401, "authorization: missing or wrong bearer token")
        try:
            body = await read_body(request)
        except _TooLarge as e:
            return error(
                413,
                f"request body: {e.args[0]} bytes exceeds the limit of {max_request_bytes} bytes",
            )
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"request body: not valid JSON ({e})")
        try:
            inp = decode_input(obj)
        except (WireError, RewardInputError) as e:
            return error(400, str(e))
        n = inp.batch_size
        if n == 0:
            return error(
                400,
                "request body: no samples (send images, videos, latents, audio, texts or prompts)",
            )
        if n > max_samples_per_request:
            return error(
                413, f"request body: {n} samples exceeds the limit of {max_samples_per_request}"
            )
        try:
            out, batch_samples = await coalescer.submit(inp)
        except RewardInputError as e:
            return error(422, str(e))
        except ValueError as e:
            return error(422, f"{type(e).__name__}: {e}")
        except Exception as e:
            log.exception("reward failed")
            return error(500, f"reward {reward.name!r} failed: {type(e).__name__}: {e}")
        payload = out.to_json()
        payload["batch_samples"] = batch_samples
        return JSONResponse(payload)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "reward": reward.name})

    async def stats(request: Request) -> JSONResponse:
        if not authorised(request):
            return error(401, "authorization: missing or wrong bearer token")
        return JSONResponse(dict(coalescer.stats))

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        yield
        await coalescer.close()

    app = Starlette(
        routes=[
            Route("/score", score, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.coalescer = coalescer
    return app


def serve(
    reward: Reward,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    max_request_bytes: int = 64 * 1024 * 1024,
    max_batch: int = 64,
    max_wait_ms: float = 5.0,
    log_level: str = "info",
) -> None:
    """Run the server until interrupted."""
    uvicorn = require_module("uvicorn", "server", "serve")
    if host not in ("127.0.0.1", "localhost", "::1") and not token:
        log.warning(
            "serving on %s without a bearer token: anyone who can reach it can use it", host
        )
    app = create_app(
        reward,
        token=token,
        max_request_bytes=max_request_bytes,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
    )
    uvicorn.run(app, host=host, port=int(port), log_level=log_level)
