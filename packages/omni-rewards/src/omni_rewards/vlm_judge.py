"""``vlm_judge``: a vision-language model behind an OpenAI-compatible chat endpoint as a reward.

Two modes (extra ``server`` for httpx):

- ``mode="score"``: the judge rates how well the image matches the prompt on a 0..``scale``
  scale; score = clip(n / scale, 0, 1), n = the first number in the answer (``"7"``,
  ``"Score: 7/10"``, ``"7.5 out of 10"``).
- ``mode="ocr"``: the judge transcribes the text in the image; the transcription is scored
  against the target text exactly like the ``ocr`` reward (1 - capped edit distance / len).

Requests go to ``{url}/chat/completions`` with the image as a PNG data URL, temperature 0.
Timeouts per request; retries with exponential backoff (honouring ``Retry-After``) on
connection errors, timeouts, 429 and 5xx; other 4xx raise at once. An answer that cannot be
parsed raises an error that names the sample and quotes the answer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import time
from typing import Any

import numpy as np

from .base import Reward, RewardError, require_module
from .ocr import extract_target, ocr_score
from .types import RewardInput, RewardInputError, RewardOutput
from .wire import encode_png

__all__ = ["VLMJudgeReward", "parse_rating"]

SCORE_PROMPT = (
    "You are judging a generated image. Prompt: {prompt!r}. On a scale of 0 to {scale}, how well "
    "does the image match the prompt (content, attributes, counts, text, quality)? "
    "Answer with the number only."
)
OCR_PROMPT = (
    "Transcribe all text visible in the image exactly. Answer with the text only, nothing else."
)

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_rating(answer: str, scale: float) -> float | None:
    """The first number in ``answer`` divided by ``scale`` (clipped to [0, 1]), or None."""
    m = _NUMBER.search(answer.replace(",", "."))
    if m is None:
        return None
    return float(min(max(float(m.group(0)) / scale, 0.0), 1.0))


class VLMJudgeReward(Reward):
    """Options: ``url`` (e.g. ``http://127.0.0.1:8000/v1``), ``model``, ``mode`` (score|ocr),
    ``api_key`` (or env ``OPENAI_API_KEY``), ``timeout`` seconds per request, ``retries``,
    ``backoff`` seconds, ``scale`` (10), ``max_tokens``, ``concurrency`` (parallel requests),
    ``prompt_template``. Inputs: ``images`` and ``prompts`` (mode ocr: target in double quotes,
    or ``references``). ``details["answer"]`` holds the judge's raw answers.
    """

    name = "vlm_judge"
    default_batch_size = 32

    def __init__(
        self,
        url: str | None = None,
        *,
        model: str = "default",
        mode: str = "score",
        api_key: str | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        scale: float = 10.0,
        max_tokens: int = 64,
        concurrency: int = 8,
        prompt_template: str | None = None,
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, workers=workers)
        self.httpx = require_module("httpx", "server", "vlm_judge")
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"url: vlm_judge needs the endpoint base URL (http://.../v1), got {url!r}"
            )
        if mode not in ("score", "ocr"):
            raise ValueError(f"mode: expected 'score' or 'ocr', got {mode!r}")
        if scale <= 0:
            raise ValueError(f"scale: must be > 0, got {scale}")
        self.url = url.rstrip("/") + "/chat/completions"
        self.model = model
        self.mode = mode
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.scale = float(scale)
        self.max_tokens = int(max_tokens)
        self.concurrency = max(1, int(concurrency))
        self.template = prompt_template or (SCORE_PROMPT if mode == "score" else OCR_PROMPT)
        self.stats = {"requests": 0, "retries": 0}

    def _body(self, image: np.ndarray, prompt: str) -> dict[str, Any]:
        text = self.template.format(
            prompt=prompt, scale=int(self.scale) if self.scale.is_integer() else self.scale
        )
        return {
            "model": self.model,
            "temperature": 0,
            "max_tokens": self.max_tokens,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64," + encode_png(image)},
                        },
                        {"type": "text", "text": text},
                    ],
                }
            ],
        }

    def ask(self, client: Any, image: np.ndarray, prompt: str) -> str:
        """One chat request with retries; returns the answer text."""
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = self._body(image, prompt)
        last = ""
        for attempt in range(self.retries + 1):
            self.stats["requests"] += 1
            wait = self.backoff * 2**attempt
            try:
                resp = client.post(self.url, json=body, headers=headers, timeout=self.timeout)
            except (self.httpx.TransportError, self.httpx.TimeoutException) as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code == 200:
                    try:
                        return str(resp.json()["choices"][0]["message"]["content"] or "")
                    except (ValueError, KeyError, IndexError, TypeError) as e:
                        raise RewardError(
                            f"{self.url}: unexpected response shape ({e}): {resp.text[:200]}"
                        ) from e
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                if resp.status_code != 429 and resp.status_code < 500:
                    raise RewardError(f"{self.url}: {last}")
                ra = resp.headers.get("retry-after")
                if ra is not None:
                    with contextlib.suppress(ValueError):
                        wait = max(wait, min(float(ra), 60.0))
            if attempt < self.retries:
                self.stats["retries"] += 1
                time.sleep(wait)
        raise RewardError(f"{self.url}: failed after {self.retries + 1} tries: {last}")

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        images = inp.image_list(self.name)
        if self.mode == "ocr":
            if inp.references is not None:
                targets = [str(r) for r in inp.references]
            else:
                targets = []
                for i, p in enumerate(inp.prompt_list(self.name)):
                    t = extract_target(p)
                    if t is None:
                        raise RewardInputError(f"prompts[{i}]: no text in double quotes in {p!r}")
                    targets.append(t)
            prompts = [""] * len(images)
        else:
            prompts = inp.prompt_list(self.name)
            targets = []
        with (
            self.httpx.Client() as client,
            concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool,
        ):
            answers = list(pool.map(lambda ip: self.ask(client, *ip), zip(images, prompts)))
        scores = []
        for i, ans in enumerate(answers):
            if self.mode == "ocr":
                scores.append(ocr_score(ans, targets[i]))
            else:
                s = parse_rating(ans, self.scale)
                if s is None:
                    raise RewardError(
                        f"vlm_judge: sample {i}: no number in the judge's answer {ans[:200]!r}"
                    )
                scores.append(s)
        return RewardOutput(
            np.array(scores, np.float32), {"answer": np.array(answers, dtype=object)}
        )
