"""HTTP API over an engine (Starlette + uvicorn; the ``server`` extra).

Endpoints (JSON errors are ``{"error": message, "field": name-or-null, "kind": ...}``):

- ``POST /generate``: JSON body ``{"prompt", "seed", "params": {...}, "request_id",
  "negative_prompt", "image"?}`` (a `RolloutRequest`; ``image`` is base64 of a safetensors
  blob with one uint8 (H, W, 3) tensor ``image``, or of PNG/JPEG bytes); answers the trajectory as safetensors bytes
  (``application/octet-stream``, see `diffusion_rollout.wire`). 400 names the bad field;
  409 = weights version mismatch; 503 = aborted (retry); 500 = the model failed.
- ``POST /update_weights``: safetensors bytes of name -> tensor, version in the blob's
  metadata ``version`` or the query ``?version=N``; answers ``{"version", "checksum"}``.
  Metadata ``lora_config`` (JSON ``{"rank", "alpha", "target_modules"}``): the LoRA adapter
  the tensors need, added first when the served model has none (400 ``lora_config`` when
  LoRA tensors come without one, or it contradicts the tensors or the adapter there).
- ``GET /health``: ``{"status": "ok", "version"}`` (no token needed).
- ``GET /stats``: the engine's ``stats()``.

Bearer token: when ``token`` is set every endpoint but ``/health`` needs
``Authorization: Bearer <token>`` (401 otherwise). Concurrent ``/generate`` calls are what the
engine batches: each waits on its own future while the scheduler thread packs them into waves.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .lora import METADATA_KEY as LORA_METADATA_KEY
from .lora import LoraSpec
from .params import RolloutRequest
from .types import RequestAborted, VersionMismatchError
from .wave import check_images
from .wire import tensors_from_bytes, trajectory_to_bytes, weights_checksum

__all__ = ["create_app"]

_FIELD = re.compile(r"\b(SamplingParams|RolloutRequest)\.(\w+)")
_MAX_JSON = 64 << 20  # a request body: JSON, with a base64 condition image at most


def _error(status: int, message: str, *, field: str | None = None, kind: str = "bad_request"):
    return JSONResponse({"error": message, "field": field, "kind": kind}, status_code=status)


def _field_of(message: str) -> str | None:
    m = _FIELD.search(message)
    if not m:
        m2 = re.search(r"unknown field\(s\) \[([^\]]*)\]", message)
        return m2.group(1).split(",")[0].strip(" '\"") if m2 else None
    return ("params." if m.group(1) == "SamplingParams" else "") + m.group(2)


def create_app(engine: Any, *, token: str | None = None, max_body_mb: float = 2048) -> Starlette:
    """A Starlette app serving ``engine`` (an `EmbeddedEngine` or anything with the same
    ``generate`` / ``update_weights`` / ``stats`` / ``version``)."""
    max_body = int(max_body_mb * 1024 * 1024)

    def authorized(request: Request) -> bool:
        if not token:
            return True
        got = request.headers.get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {token}".encode())

    def unauthorized() -> Response:
        return JSONResponse(
            {"error": "missing or wrong bearer token", "field": "Authorization", "kind": "auth"},
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def read_body(request: Request, limit: int) -> bytes:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limit:
            raise _TooLarge(int(size), limit)
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise _TooLarge(total, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def generate(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        try:
            body = await read_body(request, _MAX_JSON)
        except _TooLarge as exc:
            return _error(413, str(exc), field="body")
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _error(400, f"body is not valid JSON: {exc}", field="body")
        try:
            req = RolloutRequest.from_dict(data)
            denoiser = getattr(engine, "denoiser", None)
            if denoiser is not None:
                check_images(denoiser, [req], "request")
        except (ValueError, TypeError) as exc:
            msg = str(exc)
            return _error(400, msg, field=_field_of(msg))
        try:
            traj = await engine.generate(req)
        except VersionMismatchError as exc:
            return _error(409, str(exc), field="params.weights_version", kind="version_mismatch")
        except RequestAborted as exc:
            return _error(503, str(exc), kind="aborted")
        except Exception as exc:  # the model failed on this wave; the server keeps serving
            return _error(500, f"{type(exc).__name__}: {exc}", kind="engine_error")
        payload = await asyncio.to_thread(trajectory_to_bytes, traj)
        return Response(payload, media_type="application/octet-stream")

    async def update_weights(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        try:
            body = await read_body(request, max_body)
        except _TooLarge as exc:
            return _error(413, str(exc), field="body")
        try:
            tensors, meta = await asyncio.to_thread(tensors_from_bytes, body)
        except ValueError as exc:
            return _error(400, f"body: {exc}", field="body")
        raw = request.query_params.get("version", meta.get("version"))
        if raw is None:
            return _error(
                400, "version is required (query ?version=N or metadata)", field="version"
            )
        try:
            version = int(raw)
        except ValueError:
            return _error(400, f"version must be an integer, got {raw!r}", field="version")
        lora_kw: dict[str, Any] = {}
        if meta.get(LORA_METADATA_KEY):
            try:
                lora_kw["lora"] = LoraSpec.from_json(meta[LORA_METADATA_KEY])
            except ValueError as exc:
                return _error(400, str(exc), field="lora_config")
        try:
            await asyncio.to_thread(engine.update_weights, tensors, version, **lora_kw)
        except ValueError as exc:
            if str(exc).startswith("lora_config"):
                return _error(400, str(exc), field="lora_config")
            return _error(409 if "not newer" in str(exc) else 400, str(exc), field="version")
        except (KeyError, TypeError, RuntimeError) as exc:
            return _error(400, f"weights rejected: {exc}", field="body")
        checksum = await asyncio.to_thread(weights_checksum, tensors)
        return JSONResponse({"version": version, "checksum": checksum, "tensors": len(tensors)})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "version": engine.version})

    async def stats(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        return JSONResponse(engine.stats())

    return Starlette(
        routes=[
            Route("/generate", generate, methods=["POST"]),
            Route("/update_weights", update_weights, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
        ]
    )


class _TooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"body of {size} bytes exceeds the limit of {limit} bytes")
