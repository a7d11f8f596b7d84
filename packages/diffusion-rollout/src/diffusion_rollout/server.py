"""HTTP API over an engine (Starlette + uvicorn; the ``server`` extra).

Endpoints (every error is JSON ``{"error": message, "field": name-or-null, "kind": ...}``):

- ``POST /generate``: JSON body ``{"prompt", "seed", "params": {...}, "request_id",
  "negative_prompt", "image"?}`` (a `RolloutRequest`; ``image`` is base64 of a safetensors
  blob with one uint8 (H, W, 3) tensor ``image``, or of PNG/JPEG bytes); answers the
  trajectory as safetensors bytes (``application/octet-stream``, see `diffusion_rollout.wire`).
- ``POST /update_weights``: safetensors bytes of name -> tensor, version in the blob's
  metadata ``version`` or the query ``?version=N``; answers ``{"version", "checksum",
  "tensors"}``. All or nothing: every tensor is checked before any is applied. Metadata
  ``lora_config`` (JSON ``{"rank", "alpha", "target_modules"}``): the LoRA adapter the tensors
  need, added first when the served model has none (400 ``lora_config`` when LoRA tensors come
  without one, or it contradicts the tensors or the adapter there).
- ``GET /health``: ``{"status": "ok", "version"}`` (no token needed).
- ``GET /stats``: the engine's ``stats()`` plus the server's own counters under ``"server"``
  and the connection rules' (`diffusion_rollout.serving`) under ``"connections"``.

Status codes: 400 a malformed or out-of-limit request (``field`` names it; limits in
`diffusion_rollout.limits`), 401 a missing or wrong bearer token (checked before the body is
read), 404 / 405 unknown path or method, 408 a request that did not arrive within the read
timeout, 409 a weights version mismatch, 413 a body over the endpoint's limit, 429 too many
requests in flight (``Retry-After``), 503 an aborted request (retry) or a full connection
table, 504 a request past its deadline (it was stopped), 500 the model itself failed. The
server keeps serving after every one of them.

Concurrent ``/generate`` calls are what the engine batches: each waits on its own future while
the scheduler thread packs them into waves. A request whose client disconnects, or that runs
past ``request_timeout_s``, is cancelled in the engine: taken off the queue, or stopped at its
wave's next step boundary, freeing its rows. JSON parsing, image decoding, safetensors
parsing and weight checks run in worker threads, so ``/health`` answers while they work.
Those threads run torch with one thread each: only the scheduler thread holds an OpenMP team
(`EmbeddedEngine`: two teams on the same cores stop libgomp's spin-waiting).
"""

from __future__ import annotations

import asyncio
import hmac
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .limits import LimitError, RolloutLimits, check_request
from .lora import METADATA_KEY as LORA_METADATA_KEY
from .lora import LoraSpec
from .params import RolloutRequest
from .safe_json import JSONBodyError, parse_json_body
from .types import RequestAborted, VersionMismatchError
from .wave import check_images
from .weights import WeightsRejected
from .wire import tensors_from_bytes, trajectory_to_bytes, weights_checksum

__all__ = ["create_app"]

_FIELD = re.compile(r"\b(SamplingParams|RolloutRequest)\.(\w+)")
_VERSION = re.compile(r"\d{1,18}")
# a response that refuses a request before its body was read closes the connection, so the
# unread body is never drained
_CLOSE = {"connection": "close"}


def _one_torch_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with one torch thread in this (``asyncio.to_thread``) worker.

    The setting is per thread and stays, so the worker never starts an OpenMP team; the
    engine's scheduler thread sets its own count (`EmbeddedEngine` ``threads``)."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    return fn(*args, **kwargs)


def _error(
    status: int,
    message: str,
    *,
    field: str | None = None,
    kind: str = "bad_request",
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": message, "field": field, "kind": kind}, status_code=status, headers=headers
    )


def _field_of(message: str) -> str | None:
    m = _FIELD.search(message)
    if not m:
        m2 = re.search(r"unknown field\(s\) \[([^\]]*)\]", message)
        return m2.group(1).split(",")[0].strip(" '\"") if m2 else None
    return ("params." if m.group(1) == "SamplingParams" else "") + m.group(2)


_LOAD_FIELD = re.compile(r"load_weights: ([^\s:]+):")


def _weights_error(exc: Exception) -> JSONResponse:
    """400 for an update the denoiser's ``load_weights`` refused (before copying anything:
    omni-adapters checks every tensor first); names the tensor when the message does."""
    msg = str(exc).strip("'\"")
    m = _LOAD_FIELD.search(msg)
    return _error(
        400, f"weights rejected: {msg}", field=m.group(1) if m else "body", kind="weights_rejected"
    )


def _connection_events() -> dict[str, int]:
    """What `diffusion_rollout.serving`'s connection rules did (empty under another server)."""
    try:
        from .serving import CONNECTION_EVENTS
    except ImportError:  # served by something other than uvicorn
        return {}
    return dict(CONNECTION_EVENTS)


class _BodyError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to be over ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _BodyError(400, f"content-length {declared[:40]!r} is not a byte count")
        if int(declared) > limit:
            raise _BodyError(413, f"body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise _BodyError(413, f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (after the body was read, uvicorn's ``receive``
    only answers ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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
        response = _error(
            401,
            "missing or wrong bearer token",
            field="Authorization",
            kind="auth",
            headers={"WWW-Authenticate": "Bearer", **_CLOSE},
        )
        await response(scope, receive, send)


def create_app(
    engine: Any, *, token: str | None = None, limits: RolloutLimits | None = None
) -> Starlette:
    """A Starlette app serving ``engine`` (an `EmbeddedEngine` or anything with the same
    ``submit`` / ``cancel`` or ``generate``, ``update_weights``, ``stats``, ``version``)
    under ``limits`` (`RolloutLimits` defaults when None)."""
    limits = limits or RolloutLimits()
    counts: Counter[str] = Counter()
    busy = {"generate": 0, "weights": False}
    denoiser = getattr(engine, "denoiser", None)

    def refuse(kind: str, response: JSONResponse) -> JSONResponse:
        counts[kind] += 1
        return response

    def parse_request(body: bytes) -> RolloutRequest:
        req = RolloutRequest.from_dict(
            parse_json_body(body), max_image_pixels=limits.max_image_pixels
        )
        if denoiser is not None:
            check_images(denoiser, [req], "request")
        return check_request(req, limits, denoiser)

    async def generate(request: Request) -> Response:
        if busy["generate"] >= limits.max_queue:
            return refuse(
                "overloaded",
                _error(
                    429,
                    f"the server has {limits.max_queue} requests in flight; retry later",
                    kind="overloaded",
                    headers={"Retry-After": "1", **_CLOSE},
                ),
            )
        busy["generate"] += 1
        try:
            return await _generate(request)
        finally:
            busy["generate"] -= 1

    async def _generate(request: Request) -> Response:
        try:
            body = await _read_body(request, limits.max_body_bytes)
        except _BodyError as exc:
            kind = "too_large" if exc.status == 413 else "bad_request"
            return refuse(
                kind, _error(exc.status, str(exc), field="body", kind=kind, headers=_CLOSE)
            )
        except ClientDisconnect:
            counts["client_gone"] += 1
            return Response(status_code=400)
        try:
            req = await asyncio.to_thread(_one_torch_thread, parse_request, body)
        except LimitError as exc:
            return refuse("over_limit", _error(400, str(exc), field=exc.field, kind="over_limit"))
        except JSONBodyError as exc:
            return refuse("invalid", _error(400, str(exc), field=exc.field))
        except (ValueError, TypeError) as exc:
            msg = str(exc)
            return refuse("invalid", _error(400, msg, field=_field_of(msg)))
        del body
        submit, cancel = getattr(engine, "submit", None), getattr(engine, "cancel", None)
        try:
            if callable(submit) and callable(cancel):
                future = submit(req)
                waiter = asyncio.wrap_future(future)

                def stop() -> None:
                    cancel(future)
            else:  # an engine with only the coroutine: cancelling the task is all we can do
                waiter = asyncio.ensure_future(engine.generate(req))
                stop = waiter.cancel
        except RequestAborted as exc:
            return refuse("aborted", _error(503, str(exc), kind="aborted"))
        except (ValueError, TypeError) as exc:
            msg = str(exc)
            return refuse("invalid", _error(400, msg, field=_field_of(msg)))
        gone = asyncio.ensure_future(_client_gone(request))
        done, _ = await asyncio.wait(
            {waiter, gone}, timeout=limits.request_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        gone.cancel()
        if waiter not in done:
            stop()  # off the queue, or out of its wave at the next step boundary
            waiter.cancel()
            if gone in done:
                counts["client_gone"] += 1
                return Response(status_code=499)  # nobody is listening
            return refuse(
                "deadline",
                _error(
                    504,
                    f"request not finished within {limits.request_timeout_s:g} s; it was stopped",
                    kind="deadline",
                ),
            )
        try:
            traj = waiter.result()
        except VersionMismatchError as exc:
            return refuse(
                "version",
                _error(409, str(exc), field="params.weights_version", kind="version_mismatch"),
            )
        except RequestAborted as exc:
            return refuse("aborted", _error(503, str(exc), kind="aborted"))
        except Exception as exc:  # the model failed on this wave; the server keeps serving
            counts["engine_error"] += 1
            return _error(500, f"{type(exc).__name__}: {exc}", kind="engine_error")
        payload = await asyncio.to_thread(_one_torch_thread, trajectory_to_bytes, traj)
        counts["answered"] += 1
        return Response(payload, media_type="application/octet-stream")

    async def update_weights(request: Request) -> Response:
        if busy["weights"]:  # one upload at a time: bodies are large
            return refuse(
                "overloaded",
                _error(
                    429,
                    "another weight update is in progress; retry later",
                    kind="overloaded",
                    headers={"Retry-After": "1", **_CLOSE},
                ),
            )
        busy["weights"] = True
        try:
            return await _update_weights(request)
        finally:
            busy["weights"] = False

    async def _update_weights(request: Request) -> Response:
        try:
            body = await _read_body(request, limits.max_weights_bytes)
        except _BodyError as exc:
            kind = "too_large" if exc.status == 413 else "bad_request"
            return refuse(
                kind, _error(exc.status, str(exc), field="body", kind=kind, headers=_CLOSE)
            )
        except ClientDisconnect:
            counts["client_gone"] += 1
            return Response(status_code=400)
        try:
            tensors, meta = await asyncio.to_thread(_one_torch_thread, tensors_from_bytes, body)
        except ValueError as exc:
            return refuse("invalid", _error(400, f"body: {exc}", field="body"))
        del body
        raw = request.query_params.get("version", meta.get("version"))
        if raw is None:
            return refuse(
                "invalid",
                _error(400, "version is required (query ?version=N or metadata)", field="version"),
            )
        if not isinstance(raw, str) or not _VERSION.fullmatch(raw):
            return refuse(
                "invalid",
                _error(
                    400,
                    f"version must be an integer in [0, 10**18), got {raw!r:.40}",
                    field="version",
                ),
            )
        version = int(raw)
        lora_kw: dict[str, Any] = {}
        if meta.get(LORA_METADATA_KEY):
            try:
                lora_kw["lora"] = LoraSpec.from_json(meta[LORA_METADATA_KEY])
            except ValueError as exc:
                return refuse("invalid", _error(400, str(exc), field="lora_config"))
        try:
            await asyncio.to_thread(
                _one_torch_thread, engine.update_weights, tensors, version, **lora_kw
            )
        except WeightsRejected as exc:
            return refuse(
                "invalid", _error(400, str(exc), field=exc.field, kind="weights_rejected")
            )
        except ValueError as exc:
            if str(exc).startswith("lora_config"):
                return refuse("invalid", _error(400, str(exc), field="lora_config"))
            if "not newer" in str(exc):
                return refuse("version", _error(409, str(exc), field="version", kind="version"))
            return refuse("invalid", _weights_error(exc))
        except (KeyError, TypeError, RuntimeError) as exc:
            return refuse("invalid", _weights_error(exc))
        checksum = await asyncio.to_thread(_one_torch_thread, weights_checksum, tensors)
        counts["weights"] += 1
        return JSONResponse({"version": version, "checksum": checksum, "tensors": len(tensors)})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "version": engine.version})

    async def stats(request: Request) -> Response:
        out = dict(engine.stats())
        out["server"] = {"in_flight": busy["generate"], **counts}
        out["connections"] = _connection_events()
        return JSONResponse(out)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
        return _error(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind
        )

    async def internal_error(request: Request, exc: Exception) -> Response:
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", kind="internal")

    app = Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/update_weights", update_weights, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
        ],
        middleware=[Middleware(_BearerGate, token=token)],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
    )
    app.state.limits = limits
    return app
