"""What one HTTP rollout request may ask of the server: `RolloutLimits` and `check_request`.

The engine runs whatever it is given; the server is where a stranger's request meets it. So
before a request is queued, `check_request` holds it to the server's limits (each
configurable, `diffusion-rollout serve --help`) and to what the denoiser can run:

- ``max_steps``: ``params.num_steps``;
- ``max_pixels``: ``height x width x num_frames`` of one request; ``max_wave_pixels`` (the
  engine's) the sum over the rows of one wave, so large requests run in smaller waves;
- ``max_guidance_scale`` / ``max_noise_level``: finite is not enough, ``guidance_scale=1e308``
  overflows to NaN log-probs;
- ``max_prompt_tokens``: the prompt and negative prompt are cut to ``max_prompt_tokens x
  CHARS_PER_TOKEN`` characters *before* the denoiser tokenises them (its text encoders
  truncate to a fixed length anyway, but tokenising a megabyte of text first takes minutes);
- the denoiser's own shape rules (``denoiser.latent_shape(params)`` where it has one, e.g.
  SD3 needs height and width in multiples of 16; ``num_frames`` 1 for a denoiser whose
  ``modality`` is ``"image"``), so ``height=33`` is a 400 that names ``params.height``, not
  a 500 from inside a wave.

Queue, deadline and body limits live here too and are applied by `diffusion_rollout.server`;
`HTTPLimits` (read / idle timeouts, connection cap) by `diffusion_rollout.serving`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from .params import MAX_IMAGE_PIXELS, RolloutRequest

__all__ = ["CHARS_PER_TOKEN", "HTTPLimits", "LimitError", "RolloutLimits", "check_request"]

#: an upper bound on the characters of one token of the tokenizers in use (CLIP and
#: Qwen2 byte-level BPE, T5 sentencepiece): cutting a prompt to ``tokens x 32`` characters
#: keeps every token the text encoder would have kept
CHARS_PER_TOKEN = 32


class LimitError(ValueError):
    """A request over a server limit, or one the denoiser cannot run; ``field`` names it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


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
    """Connection limits, applied by `diffusion_rollout.serving` (see its docstring)."""

    read_timeout_s: float = _limit(30.0, "a request's headers and body must arrive within this")
    idle_timeout_s: float = _limit(5.0, "a keep-alive connection with no request is closed")
    max_connections: int = _limit(1024, "open connections; the longest-reading is evicted first")

    def __post_init__(self) -> None:
        _check_positive(self)


@dataclass(frozen=True)
class RolloutLimits:
    """The rollout server's limits; every field is a `diffusion-rollout serve` flag
    (``--max-steps`` ...), with these defaults."""

    max_steps: int = _limit(200, "most params.num_steps of one request")
    max_pixels: int = _limit(2048 * 2048, "most height x width x num_frames of one request")
    max_wave_pixels: int = _limit(
        16 * 1024 * 1024,
        "most pixels summed over the rows of one wave (large requests: smaller waves)",
    )
    max_guidance_scale: float = _limit(100.0, "most guidance_scale and true_cfg_scale")
    max_noise_level: float = _limit(10.0, "most noise_level")
    max_prompt_tokens: int = _limit(
        512, f"prompts are cut to this many tokens x {CHARS_PER_TOKEN} characters before encoding"
    )
    max_image_pixels: int = _limit(MAX_IMAGE_PIXELS, "most pixels of a condition image")
    max_queue: int = _limit(1024, "most /generate requests in flight; more get 429")
    request_timeout_s: float = _limit(600.0, "a /generate request is stopped after this (504)")
    max_body_mb: float = _limit(32.0, "most MiB of a /generate body")
    max_weights_mb: float = _limit(1024.0, "most MiB of an /update_weights body")
    http: HTTPLimits = field(default_factory=HTTPLimits)

    def __post_init__(self) -> None:
        _check_positive(self)

    @property
    def max_prompt_chars(self) -> int:
        return self.max_prompt_tokens * CHARS_PER_TOKEN

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    @property
    def max_weights_bytes(self) -> int:
        return int(self.max_weights_mb * 1024 * 1024)


_DENOISER_FIELD = re.compile(r"^(height|width|num_frames|num_steps)\b")


def check_request(
    request: RolloutRequest, limits: RolloutLimits, denoiser: Any = None
) -> RolloutRequest:
    """``request`` within ``limits`` and runnable by ``denoiser``, prompts cut to length;
    `LimitError` naming the field otherwise."""
    p = request.params
    if p.num_steps > limits.max_steps:
        raise LimitError(
            f"params.num_steps={p.num_steps} is over this server's limit of {limits.max_steps}",
            "params.num_steps",
        )
    pixels = p.height * p.width * p.num_frames
    if pixels > limits.max_pixels:
        raise LimitError(
            f"params: height x width x num_frames = {p.height} x {p.width} x {p.num_frames} = "
            f"{pixels} pixels is over this server's limit of {limits.max_pixels}",
            "params.num_frames" if p.height * p.width <= limits.max_pixels else "params.height",
        )
    for name in ("guidance_scale", "true_cfg_scale"):
        if getattr(p, name) > limits.max_guidance_scale:
            raise LimitError(
                f"params.{name}={getattr(p, name):g} is over this server's limit of "
                f"{limits.max_guidance_scale:g}",
                f"params.{name}",
            )
    if p.noise_level > limits.max_noise_level:
        raise LimitError(
            f"params.noise_level={p.noise_level:g} is over this server's limit of "
            f"{limits.max_noise_level:g}",
            "params.noise_level",
        )
    if len(request.request_id) > 256:
        raise LimitError("request_id is longer than 256 characters", "request_id")
    if getattr(denoiser, "modality", None) == "image" and p.num_frames != 1:
        raise LimitError(
            f"params.num_frames={p.num_frames}: the model makes images (num_frames must be 1)",
            "params.num_frames",
        )
    if denoiser is not None and callable(getattr(denoiser, "latent_shape", None)):
        try:
            denoiser.latent_shape(p)
        except (ValueError, TypeError) as exc:
            m = _DENOISER_FIELD.match(str(exc))
            name = f"params.{m.group(1)}" if m else "params"
            raise LimitError(f"params: the model cannot run this request: {exc}", name) from None
    cut = limits.max_prompt_chars
    changes: dict[str, Any] = {}
    if len(request.prompt) > cut:
        changes["prompt"] = request.prompt[:cut]
    if request.negative_prompt is not None and len(request.negative_prompt) > cut:
        changes["negative_prompt"] = request.negative_prompt[:cut]
    return dataclasses.replace(request, **changes) if changes else request
