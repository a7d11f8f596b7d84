"""`RolloutClient`: the batched rollout client a trainer uses, over an engine or a URL.

It submits a whole batch at once (up to ``concurrency`` requests in flight), returns the
trajectories in request order, retries requests the engine or server aborted (with backoff,
at most ``max_retries`` times each), raises `VersionMismatchError` when a trajectory comes
back on another weights version than asked, and shows a tqdm progress bar for long batches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .params import RolloutRequest
from .types import RequestAborted, Trajectory, VersionMismatchError

__all__ = ["RolloutClient"]


def _copy_outcome(src: asyncio.Future, dst: asyncio.Future) -> None:
    if dst.done():
        return
    if src.cancelled():
        dst.cancel()
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


class _EngineBackend:
    """In-process engine. Submissions made in one event-loop turn are handed to the engine in
    one ``submit_many`` call when it has one, so they can share the first wave."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._pending: list[tuple[RolloutRequest, asyncio.Future]] = []
        self._flush_scheduled = False

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        try:
            futs = self.engine.submit_many([r for r, _ in pending])
        except BaseException as exc:
            for _, waiter in pending:
                if not waiter.done():
                    waiter.set_exception(exc)
            return
        for (_, waiter), fut in zip(pending, futs):
            wrapped = asyncio.wrap_future(fut)
            wrapped.add_done_callback(lambda src, dst=waiter: _copy_outcome(src, dst))
            waiter.add_done_callback(lambda w, f=fut: f.cancel() if w.cancelled() else None)

    async def generate(self, request: RolloutRequest) -> Trajectory:
        if not hasattr(self.engine, "submit_many"):
            return await self.engine.generate(request)
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._pending.append((request, waiter))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await waiter

    async def update_weights(
        self, tensors: dict[str, Tensor], version: int, lora_config: dict | None = None
    ) -> dict:
        kw = {} if lora_config is None else {"lora": lora_config}
        await asyncio.to_thread(self.engine.update_weights, tensors, version, **kw)
        return {"version": version}

    async def stats(self) -> dict:
        return self.engine.stats()

    async def aclose(self) -> None:
        return None


class _HttpBackend:
    """A `diffusion-rollout serve` server. One HTTP call per request; the server batches."""

    def __init__(self, url: str, token: str | None, timeout_s: float, concurrency: int) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._httpx = httpx
        self.client = httpx.AsyncClient(
            base_url=url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        )

    def _raise(self, resp: Any) -> None:
        try:
            body = resp.json()
            msg = body.get("error", resp.text)
        except ValueError:
            msg = resp.text
        if resp.status_code == 409:
            raise VersionMismatchError(msg)
        if resp.status_code in (429, 503):  # overloaded or aborted: retried with backoff
            raise RequestAborted(msg)
        if 400 <= resp.status_code < 500:
            raise ValueError(f"server rejected the request ({resp.status_code}): {msg}")
        raise RuntimeError(f"server error ({resp.status_code}): {msg}")

    async def generate(self, request: RolloutRequest) -> Trajectory:
        from .wire import trajectory_from_bytes

        try:
            resp = await self.client.post("/generate", json=request.to_dict())
        except (
            self._httpx.ConnectError,
            self._httpx.RemoteProtocolError,
            self._httpx.ReadError,
        ) as exc:
            raise RequestAborted(f"connection to the rollout server failed: {exc}") from exc
        if resp.status_code != 200:
            self._raise(resp)
        return await asyncio.to_thread(trajectory_from_bytes, resp.content)

    async def update_weights(
        self, tensors: dict[str, Tensor], version: int, lora_config: dict | None = None
    ) -> dict:
        from .lora import METADATA_KEY
        from .wire import tensors_to_bytes

        meta = {"version": str(version)}
        if lora_config is not None:
            meta[METADATA_KEY] = json.dumps(lora_config)
        body = await asyncio.to_thread(tensors_to_bytes, tensors, meta)
        resp = await self.client.post(
            "/update_weights", content=body, headers={"content-type": "application/octet-stream"}
        )
        if resp.status_code != 200:
            self._raise(resp)
        return resp.json()

    async def stats(self) -> dict:
        resp = await self.client.get("/stats")
        if resp.status_code != 200:
            self._raise(resp)
        return resp.json()

    async def aclose(self) -> None:
        await self.client.aclose()


def _run_sync(coro_fn, *args, **kwargs):
    """Run ``coro_fn(*args)`` to completion: in this thread when no loop is running, else in a
    helper thread with its own loop (so sync calls also work inside notebooks / async code)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_fn(*args, **kwargs))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(coro_fn(*args, **kwargs))).result()


class RolloutClient:
    """Batched rollouts over an engine object or a server URL.

    Args:
        engine_or_url: an `EmbeddedEngine` / `VllmOmniEngine` (anything with ``async
            generate``), or the base URL of ``diffusion-rollout serve``.
        concurrency: the most requests in flight at once (set it >= the engine's
            ``max_num_seqs`` so waves fill).
        max_retries: retries per request after `RequestAborted` (HTTP 503, dropped
            connection); then the error is raised.
        retry_backoff_s: first retry delay, doubled each time.
        progress: show a progress bar: True, False, or None = when a batch has at least
            ``progress_min`` requests.
        token: bearer token for the server.
        timeout_s: HTTP timeout per request.

    Example:
        >>> client = RolloutClient(engine, concurrency=64)
        >>> trajs = client.generate(requests, version=3)  # pinned to weights version 3
    """

    def __init__(
        self,
        engine_or_url: Any,
        *,
        concurrency: int = 64,
        max_retries: int = 3,
        retry_backoff_s: float = 0.2,
        progress: bool | None = None,
        progress_min: int = 32,
        token: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.target = engine_or_url
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.progress = progress
        self.progress_min = progress_min
        self.token = token
        self.timeout_s = timeout_s
        self.retries = 0
        self._lock = threading.Lock()
        if not isinstance(engine_or_url, str) and not hasattr(engine_or_url, "generate"):
            raise TypeError("engine_or_url must be a URL string or an engine with generate()")

    def _backend(self):
        if isinstance(self.target, str):
            return _HttpBackend(self.target, self.token, self.timeout_s, self.concurrency)
        return _EngineBackend(self.target)

    @staticmethod
    def _pin(requests: Sequence[RolloutRequest], version: int | None) -> list[RolloutRequest]:
        if version is None:
            return list(requests)
        out = []
        for i, r in enumerate(requests):
            v = r.params.weights_version
            if v is not None and v != version:
                raise ValueError(
                    f"requests[{i}].params.weights_version={v} conflicts with version={version}"
                )
            if v is None:
                r = dataclasses.replace(r, params=r.params.replace(weights_version=version))
            out.append(r)
        return out

    async def agenerate(
        self,
        requests: Sequence[RolloutRequest],
        *,
        version: int | None = None,
        progress: bool | None = None,
    ) -> list[Trajectory]:
        """Roll out ``requests``; trajectories in request order.

        ``version`` pins every request to that weights version (the engine waits for it or
        fails); any trajectory on another version raises `VersionMismatchError`.
        """
        reqs = self._pin(requests, version)
        for i, r in enumerate(reqs):
            if not isinstance(r, RolloutRequest):
                raise TypeError(f"requests[{i}] is a {type(r).__name__}, not a RolloutRequest")
        show = progress if progress is not None else self.progress
        if show is None:
            show = len(reqs) >= self.progress_min
        backend = self._backend()
        sem = asyncio.Semaphore(self.concurrency)
        results: list[Trajectory | None] = [None] * len(reqs)

        from tqdm.auto import tqdm

        bar = tqdm(total=len(reqs), desc="rollout", unit="req", disable=not show)

        async def one(i: int, req: RolloutRequest) -> None:
            delay = self.retry_backoff_s
            attempt = 0
            while True:
                try:
                    async with sem:
                        traj = await backend.generate(req)
                    break
                except RequestAborted:
                    if attempt >= self.max_retries:
                        raise
                    attempt += 1
                    with self._lock:
                        self.retries += 1
                    await asyncio.sleep(delay)
                    delay *= 2
            want = req.params.weights_version
            if want is not None and traj.version != want:
                raise VersionMismatchError(
                    f"request {req.request_id!r} asked for weights version {want} but came back "
                    f"on version {traj.version}"
                )
            results[i] = traj
            bar.update(1)

        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(reqs)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            bar.close()
            await backend.aclose()
        return results  # type: ignore[return-value]

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        *,
        version: int | None = None,
        progress: bool | None = None,
    ) -> list[Trajectory]:
        """Blocking `agenerate`."""
        return _run_sync(self.agenerate, requests, version=version, progress=progress)

    def generate_many(
        self, requests: Sequence[RolloutRequest], *, progress: bool | None = None
    ) -> list[Trajectory]:
        """`EmbeddedEngine.generate_many`'s signature (request order; each request's own
        ``weights_version`` pin), so a trainer drives a client like an engine."""
        return self.generate(requests, progress=progress)

    @property
    def version(self) -> int:
        """The served weights version (``GET /health`` for a URL, ``engine.version`` else)."""
        if not isinstance(self.target, str):
            return int(self.target.version)
        import httpx

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        resp = httpx.get(self.target.rstrip("/") + "/health", headers=headers, timeout=30)
        resp.raise_for_status()
        return int(resp.json()["version"])

    async def aupdate_weights(
        self, tensors: dict[str, Tensor], version: int, *, lora_config: Any = None
    ) -> dict:
        """Push weights (LoRA tensors) as ``version``. ``lora_config`` (a `LoraSpec`, its dict
        or peft's ``adapter_config.json`` dict): the adapter the tensors need, added by the
        engine / server first if the served model has none (`diffusion_rollout.lora`)."""
        from .lora import LoraSpec

        spec = None
        if lora_config is not None:
            if not isinstance(lora_config, LoraSpec):
                lora_config = LoraSpec.from_dict(lora_config)
            spec = lora_config.to_dict()
        backend = self._backend()
        try:
            return await backend.update_weights(tensors, version, spec)
        finally:
            await backend.aclose()

    def update_weights(
        self, tensors: dict[str, Tensor], version: int, *, lora_config: Any = None
    ) -> dict:
        """Blocking `aupdate_weights`."""
        return _run_sync(self.aupdate_weights, tensors, version, lora_config=lora_config)

    async def astats(self) -> dict:
        backend = self._backend()
        try:
            return await backend.stats()
        finally:
            await backend.aclose()

    def stats(self) -> dict:
        """The engine's / server's stats."""
        return _run_sync(self.astats)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """For a URL: poll ``/health`` until the server answers (raises TimeoutError)."""
        if not isinstance(self.target, str):
            return
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.target.rstrip("/") + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout server at {self.target} not ready in {timeout_s} s")
            time.sleep(0.1)
