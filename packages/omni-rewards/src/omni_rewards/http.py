"""``http``: a reward scored by a remote ``omni-rewards serve`` server (extra ``server``).

score = whatever the server's reward returns. Inputs: every field the remote reward needs;
images travel as PNG, latents/audio as safetensors, all in JSON (see `omni_rewards.wire`).
Retries with exponential backoff on connection errors, 429 (waiting at least the server's
``Retry-After``, at most 30 s) and 5xx; other 4xx answers raise at once with the server's
message.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from .base import Reward, RewardError, as_input, require_module
from .types import RewardInput, RewardInputError, RewardOutput
from .wire import encode_input

__all__ = ["HTTPReward"]


class HTTPReward(Reward):
    """Client for ``omni-rewards serve``.

    Options: ``url`` (e.g. ``http://127.0.0.1:8765``), ``token`` (or env
    ``OMNI_REWARDS_TOKEN``), ``timeout`` seconds, ``retries``, ``backoff`` seconds (doubled
    per retry), ``batch_size`` (samples per request).
    """

    name = "http"

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.5,
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, workers=workers)
        self.httpx = require_module("httpx", "server", "http")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http:// or https://, got {url!r}")
        self.url = url.rstrip("/") + "/score"
        self.token = token if token is not None else os.environ.get("OMNI_REWARDS_TOKEN")
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def _handle(self, resp: Any, attempt: int) -> RewardOutput | float:
        """The scores, or the seconds to wait before the next try (429 / 5xx)."""
        if resp.status_code == 200:
            return RewardOutput.from_json(resp.json())
        try:
            msg = resp.json().get("error", resp.text)
        except ValueError:
            msg = resp.text
        if resp.status_code == 429 or resp.status_code >= 500:
            if attempt < self.retries:
                delay = self.backoff * 2**attempt
                hint = resp.headers.get("retry-after", "")
                # the server's Retry-After (seconds), capped so a bad header cannot stall us
                return max(delay, min(float(hint), 30.0)) if hint.isdigit() else delay
            raise RewardError(
                f"{self.url}: HTTP {resp.status_code} after {attempt + 1} tries: {msg}"
            )
        if resp.status_code in (400, 422):
            raise RewardInputError(f"{self.url}: HTTP {resp.status_code}: {msg}")
        raise RewardError(f"{self.url}: HTTP {resp.status_code}: {msg}")

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        body = encode_input(inp)
        with self.httpx.Client(timeout=self.timeout) as client:
            for attempt in range(self.retries + 1):
                try:
                    resp = client.post(self.url, json=body, headers=self._headers())
                except self.httpx.TransportError as e:
                    if attempt >= self.retries:
                        raise RewardError(f"{self.url}: {type(e).__name__}: {e}") from e
                else:
                    out = self._handle(resp, attempt)
                    if isinstance(out, RewardOutput):
                        return out
                    time.sleep(out)
                    continue
                time.sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    async def ascore(self, inp: RewardInput | dict | None = None, /, **fields: Any) -> RewardOutput:
        """Native async: many calls can be in flight at once (no worker thread)."""
        inp = as_input(inp, **fields)
        n = inp.batch_size
        if n == 0:
            raise RewardInputError("http: empty input")
        step = self.batch_size or n
        async with self.httpx.AsyncClient(timeout=self.timeout) as client:
            parts = await asyncio.gather(
                *(self._apost(client, inp.slice(s, min(n, s + step))) for s in range(0, n, step))
            )
        return RewardOutput.concat(parts)

    async def _apost(self, client: Any, inp: RewardInput) -> RewardOutput:
        body = encode_input(inp)
        for attempt in range(self.retries + 1):
            try:
                resp = await client.post(self.url, json=body, headers=self._headers())
            except self.httpx.TransportError as e:
                if attempt >= self.retries:
                    raise RewardError(f"{self.url}: {type(e).__name__}: {e}") from e
            else:
                out = self._handle(resp, attempt)
                if isinstance(out, RewardOutput):
                    return out
                await asyncio.sleep(out)
                continue
            await asyncio.sleep(self.backoff * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover
