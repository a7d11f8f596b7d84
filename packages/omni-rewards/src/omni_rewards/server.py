"""``omni-rewards serve``: a reward behind HTTP (Starlette + uvicorn, extra ``server``).

- Binds to 127.0.0.1 unless told otherwise; optional bearer token (``Authorization: Bearer T``).
- ``POST /score`` takes the JSON of `omni_rewards.wire` and answers
  ``{"scores", "details", "batch_samples"}``; ``GET /health``; ``GET /stats``.
- Concurrent requests are coalesced: requests that arrive within ``max_wait_ms`` of each
  other and have the same fields (and latent/audio shapes) are scored as one batch of at most
  ``max_batch`` samples, then split back. If the merged batch fails, each request is scored on
  its own, so one bad request cannot fail the others.
- Errors are JSON ``{"error": "...", "field": name-or-null, "kind": ...}`` naming the
  problem: 400 bad JSON (nesting, NaN/inf, huge integers) / base64 / image bytes / shapes /
  sample rate, 401 bad token (checked before the body is read), 404 / 405 unknown path or
  method, 408 a request that did not arrive within the read timeout, 413 a body, pixel count
  or sample count over the limit, 422 input the reward cannot score, 429 the server is full
  (``Retry-After``), 500 the reward itself failed. The server keeps serving after any of them.
- Limits (`omni_rewards.limits.RewardLimits`, each a ``serve`` flag): body bytes and decoded
  pixels per request and over all requests in flight, requests in flight, samples per
  request; connection limits (read / idle timeout, connection cap) in `omni_rewards.serving`.
- JSON parsing, image header checks and decoding run in a small thread pool
  (``decode_workers``) and scoring in the reward's executor, so the event loop, and with it
  ``/health``, stays free while a request is worked on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .base import Reward, require_module
from .limits import RewardLimits
from .safe_json import JSONBodyError, parse_json_body
from .types import RewardInput, RewardInputError, RewardOutput
from .wire import WireError, count_pixels, decode_input

__all__ = ["Coalescer", "RewardLimits", "create_app", "merge_inputs", "serve"]

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


class _Budget:
    """How much of something (body bytes, decoded pixels) the requests in flight hold, against
    a cap. Used from the event loop thread only, so it needs no lock."""

    def __init__(self, cap: int) -> None:
        self.cap = int(cap)
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.cap:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


_FIELD = re.compile(r"^([A-Za-z_]+(?:\[\d+\])*):")
_CLOSE = {"connection": "close"}


_OTHER_FIELD = re.compile(r"unknown fields \['([^']*)'|disagree on the batch size: (\w+)=")


def _field_of(message: str) -> str | None:
    """The field a wire / input error names: at its start (``images[2]: ...``), or the first
    unknown field, or the first of the fields whose sample counts disagree."""
    m = _FIELD.match(message)
    if m:
        return m.group(1)
    m = _OTHER_FIELD.search(message)
    return (m.group(1) or m.group(2)) if m else None


def _parse_and_count(body: bytes) -> tuple[Any, int]:
    """(the parsed body, the pixels its images declare): one trip to the decode pool."""
    obj = parse_json_body(body)
    return obj, count_pixels(obj)


class _BearerGate:
    """ASGI middleware: every path but ``/health`` needs ``Authorization: Bearer <token>``.
    It answers 401 before the route runs, so an unauthorised body is never read."""

    def __init__(self, app: Any, token: str | None) -> None:
        self.app = app
        self.expected = None if not token else f"Bearer {token}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(got, self.expected):
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        response = JSONResponse(
            {
                "error": "authorization: missing or wrong bearer token",
                "field": "authorization",
                "kind": "auth",
            },
            status_code=401,
            headers={"WWW-Authenticate": "Bearer", **_CLOSE},
        )
        await response(scope, receive, send)


def create_app(
    reward: Reward,
    *,
    token: str | None = None,
    max_batch: int = 64,
    max_wait_ms: float = 5.0,
    limits: RewardLimits | None = None,
) -> Any:
    """The Starlette app serving ``reward`` under ``limits`` (`RewardLimits` defaults)."""
    require_module("starlette", "server", "serve", what="omni-rewards serve")
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    limits = limits or RewardLimits()
    coalescer = Coalescer(reward, max_batch=max_batch, max_wait_ms=max_wait_ms)
    decode_pool = ThreadPoolExecutor(
        limits.decode_workers, thread_name_prefix="omni-rewards-decode"
    )
    body_budget = _Budget(limits.max_pending_bytes)
    pixel_budget = _Budget(limits.max_pending_pixels)
    counts: Counter[str] = Counter()
    in_flight = [0]

    def error(
        status: int,
        msg: str,
        *,
        field: str | None = None,
        kind: str = "bad_request",
        headers: dict[str, str] | None = None,
    ) -> JSONResponse:
        counts[kind] += 1
        return JSONResponse(
            {"error": msg, "field": field, "kind": kind}, status_code=status, headers=headers
        )

    def busy(msg: str) -> JSONResponse:
        return error(429, msg, kind="overloaded", headers={"Retry-After": "1", **_CLOSE})

    async def off_loop(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(decode_pool, fn, *args)

    async def score(request: Request) -> Response:
        if in_flight[0] >= limits.max_queue:
            return busy(f"the server has {limits.max_queue} requests in flight; retry later")
        declared = request.headers.get("content-length")
        if declared is not None and not declared.isdigit():
            return error(
                400,
                f"content-length {declared[:40]!r} is not a byte count",
                field="body",
                headers=_CLOSE,
            )
        size = int(declared) if declared is not None else limits.max_request_bytes
        if size > limits.max_request_bytes:
            return error(
                413,
                f"request body: {size} bytes exceeds the limit of {limits.max_request_bytes} bytes",
                field="body",
                kind="too_large",
                headers=_CLOSE,
            )
        if not body_budget.take(size):
            return busy("the server holds its maximum of request bodies; retry later")
        in_flight[0] += 1
        pixels = 0
        try:
            try:
                body = await read_body(request)
            except _TooLarge as e:
                return error(
                    413,
                    f"request body: {e.args[0]} bytes exceeds the limit of {limits.max_request_bytes} bytes",
                    field="body",
                    kind="too_large",
                    headers=_CLOSE,
                )
            except ClientDisconnect:
                counts["client_gone"] += 1
                return Response(status_code=400)
            try:
                obj, pixels = await off_loop(_parse_and_count, body)
                del body
            except JSONBodyError as e:
                return error(400, str(e), field=e.field)
            except WireError as e:
                return error(400, str(e), field=_field_of(str(e)))
            if pixels > limits.max_request_pixels:
                return error(
                    413,
                    f"images: the request decodes to {pixels} pixels, over the limit of "
                    f"{limits.max_request_pixels} per request",
                    field="images",
                    kind="too_large",
                )
            if not pixel_budget.take(pixels):
                pixels = 0
                return busy("the server holds its maximum of decoded pixels; retry later")
            try:
                inp = await off_loop(decode_input, obj)
            except (WireError, RewardInputError, ValueError, TypeError) as e:
                return error(400, str(e), field=_field_of(str(e)))
            del obj
            body_budget.give(size)
            size = 0
            return await run_reward(inp)
        finally:
            in_flight[0] -= 1
            body_budget.give(size)
            pixel_budget.give(pixels)

    async def run_reward(inp: RewardInput) -> Response:
        n = inp.batch_size
        if n == 0:
            return error(
                400,
                "request body: no samples (send images, videos, latents, audio, texts or prompts)",
                field="body",
            )
        if n > limits.max_samples_per_request:
            return error(
                413,
                f"request body: {n} samples exceeds the limit of {limits.max_samples_per_request}",
                field="body",
                kind="too_large",
            )
        try:
            out, batch_samples = await coalescer.submit(inp)
        except RewardInputError as e:
            return error(422, str(e), field=_field_of(str(e)), kind="unscorable")
        except ValueError as e:
            return error(
                422, f"{type(e).__name__}: {e}", field=_field_of(str(e)), kind="unscorable"
            )
        except Exception as e:
            log.exception("reward failed")
            return error(
                500, f"reward {reward.name!r} failed: {type(e).__name__}: {e}", kind="reward_error"
            )
        payload = await off_loop(out.to_json)
        payload["batch_samples"] = batch_samples
        counts["answered"] += 1
        return JSONResponse(payload)

    async def read_body(request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_request_bytes:
                raise _TooLarge(size)
            chunks.append(chunk)
        return b"".join(chunks)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "reward": reward.name})

    async def stats(request: Request) -> JSONResponse:
        out: dict[str, Any] = dict(coalescer.stats)
        out["server"] = {
            "in_flight": in_flight[0],
            "pending_bytes": body_budget.used,
            "pending_pixels": pixel_budget.used,
            **counts,
        }
        try:
            from .serving import CONNECTION_EVENTS

            out["connections"] = dict(CONNECTION_EVENTS)
        except ImportError:  # served by something other than uvicorn
            out["connections"] = {}
        return JSONResponse(out)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
        return error(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind
        )

    async def internal_error(request: Request, exc: Exception) -> Response:
        return error(500, f"internal error: {type(exc).__name__}: {exc}", kind="internal")

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        yield
        await coalescer.close()
        decode_pool.shutdown(wait=False, cancel_futures=True)

    app = Starlette(
        routes=[
            Route("/score", score, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
        ],
        middleware=[Middleware(_BearerGate, token=token)],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
    app.state.coalescer = coalescer
    app.state.limits = limits
    return app


class _TooLarge(Exception):
    pass


def serve(
    reward: Reward,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    max_batch: int = 64,
    max_wait_ms: float = 5.0,
    limits: RewardLimits | None = None,
    log_level: str = "info",
) -> None:
    """Run the server until interrupted (uvicorn behind `omni_rewards.serving`'s limits)."""
    require_module("uvicorn", "server", "serve", what="omni-rewards serve")
    from .serving import run

    if host not in ("127.0.0.1", "localhost", "::1") and not token:
        log.warning(
            "serving on %s without a bearer token: anyone who can reach it can use it", host
        )
    limits = limits or RewardLimits()
    app = create_app(
        reward, token=token, max_batch=max_batch, max_wait_ms=max_wait_ms, limits=limits
    )
    run(app, host=host, port=int(port), limits=limits.http, log_level=log_level)
