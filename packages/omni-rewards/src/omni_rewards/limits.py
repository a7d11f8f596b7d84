"""What the reward server holds requests to: `RewardLimits` and the connection `HTTPLimits`.

Every field is an ``omni-rewards serve`` flag (``--max-request-pixels`` ...). The memory a
request can pin is bounded twice: per request (``max_request_mb`` of body,
``max_request_pixels`` of decoded images and frames, counted from the image headers before
anything is decoded) and over all requests in flight (``max_pending_mb``,
``max_pending_pixels``, ``max_queue``); a request that does not fit right now gets 429 with
``Retry-After`` instead of waiting inside the server. `HTTPLimits` is applied by
`omni_rewards.serving`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HTTPLimits", "RewardLimits"]


def _limit(default: float, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _check_positive(obj: Any) -> None:
    """Every numeric field of ``obj`` is a positive finite number (an int where typed int)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type not in ("int", "float"):
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and 0 < value < float("inf") and (f.type == "float" or isinstance(value, int))
        if not ok:
            raise ValueError(
                f"{type(obj).__name__}.{f.name} must be a positive {f.type}, got {value!r}"
            )


@dataclass(frozen=True)
class HTTPLimits:
    """Connection limits, applied by `omni_rewards.serving` (see its docstring)."""

    read_timeout_s: float = _limit(30.0, "a request's headers and body must arrive within this")
    idle_timeout_s: float = _limit(5.0, "a keep-alive connection with no request is closed")
    max_connections: int = _limit(1024, "open connections; the longest-reading is evicted first")

    def __post_init__(self) -> None:
        _check_positive(self)


@dataclass(frozen=True)
class RewardLimits:
    """The reward server's limits, with these defaults."""

    max_request_mb: float = _limit(64.0, "most MiB of one /score body")
    max_samples_per_request: int = _limit(1024, "most samples in one /score request")
    max_request_pixels: int = _limit(
        32 * 1024 * 1024, "most decoded pixels (images and video frames) of one request"
    )
    max_pending_mb: float = _limit(512.0, "most MiB of bodies held by requests in flight")
    max_pending_pixels: int = _limit(
        128 * 1024 * 1024, "most decoded pixels held by requests in flight"
    )
    max_queue: int = _limit(256, "most /score requests in flight; more get 429")
    decode_workers: int = _limit(2, "threads that parse JSON and decode images")
    http: HTTPLimits = field(default_factory=HTTPLimits)

    def __post_init__(self) -> None:
        _check_positive(self)
        for one, total in (
            ("max_request_mb", "max_pending_mb"),
            ("max_request_pixels", "max_pending_pixels"),
        ):
            if getattr(self, one) > getattr(self, total):
                raise ValueError(
                    f"RewardLimits.{total} must be >= {one} ({getattr(self, one)}), got "
                    f"{getattr(self, total)}: one request must fit"
                )

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 1024 * 1024)

    @property
    def max_pending_bytes(self) -> int:
        return int(self.max_pending_mb * 1024 * 1024)
