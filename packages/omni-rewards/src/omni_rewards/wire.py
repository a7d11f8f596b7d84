"""The JSON wire format of the reward server and `HTTPReward` (never pickle).

A request is a JSON object with any of:

- ``images``: list of base64 strings, each a PNG or JPEG file;
- ``videos``: list of lists of base64 PNG/JPEG frames;
- ``latents``, ``audio``: base64 of a safetensors file holding one tensor named ``"data"``
  (batch first); ``sample_rate`` (int) with audio;
- ``texts``, ``prompts``, ``references``: lists of strings (references: also numbers);
- ``metadata``: a list of JSON objects, one per sample, or one object.

A response is ``{"scores": [...], "details": {name: [...]}}`` with NaN written as null.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from .types import RewardInput, RewardInputError, as_numpy

__all__ = ["WireError", "count_pixels", "decode_input", "encode_input", "encode_png"]

# Max decoded pixels per image (guards against decompression bombs).
MAX_PIXELS = 64 * 1024 * 1024
# Highest accepted audio sample rate (Hz); real audio is <= 384 kHz.
MAX_SAMPLE_RATE = 1_000_000


class WireError(ValueError):
    """A request could not be decoded; the message names the field and index."""


def encode_png(image: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _b64(s: Any, where: str) -> bytes:
    if not isinstance(s, str):
        raise WireError(f"{where}: expected a base64 string, got {type(s).__name__}")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise WireError(f"{where}: invalid base64 ({e})") from e


def _open_image(s: Any, where: str, decode: bool) -> tuple[int, np.ndarray | None]:
    """(pixels, RGB array or None): the header is read and checked; decoded if asked."""
    data = _b64(s, where)
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format not in ("PNG", "JPEG"):
                raise WireError(f"{where}: expected PNG or JPEG bytes, got {im.format}")
            if im.width * im.height > MAX_PIXELS:
                raise WireError(
                    f"{where}: image of {im.width}x{im.height} exceeds {MAX_PIXELS} pixels"
                )
            return im.width * im.height, np.asarray(im.convert("RGB")) if decode else None
    except WireError:
        raise
    except (
        UnidentifiedImageError,
        OSError,
        SyntaxError,
        ValueError,
        Image.DecompressionBombError,
    ) as e:
        raise WireError(f"{where}: cannot decode image bytes ({type(e).__name__}: {e})") from e


def _decode_image(s: Any, where: str) -> np.ndarray:
    return _open_image(s, where, decode=True)[1]  # type: ignore[return-value]


def count_pixels(obj: Any) -> int:
    """The pixels a request's images and video frames decode to, from their headers alone
    (nothing is decoded): what the server holds a request's pixel budget to before it
    decodes anything. WireError naming the field for a malformed image."""
    if not isinstance(obj, dict):
        return 0
    total = 0
    images = obj.get("images")
    if isinstance(images, list):
        total += sum(_open_image(s, f"images[{i}]", False)[0] for i, s in enumerate(images))
    videos = obj.get("videos")
    if isinstance(videos, list):
        for i, v in enumerate(videos):
            if isinstance(v, list):
                total += sum(_open_image(s, f"videos[{i}][{t}]", False)[0] for t, s in enumerate(v))
    return total


def _sample_rate(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SAMPLE_RATE:
        raise WireError(
            f"sample_rate: expected an integer in 1..{MAX_SAMPLE_RATE} (Hz), got {value!r:.40}"
        )
    return value


def _encode_tensor(x: Any) -> str:
    from safetensors.numpy import save

    arr = np.ascontiguousarray(as_numpy(x))
    return base64.b64encode(save({"data": arr})).decode("ascii")


def _decode_tensor(s: Any, where: str) -> np.ndarray:
    data = _b64(s, where)
    try:
        from safetensors.numpy import load
    except ImportError as e:  # pragma: no cover - server extra installs it
        raise WireError(
            f"{where}: safetensors is needed: pip install 'omni-rewards[server]'"
        ) from e
    try:
        tensors = load(data)
    except Exception as e:
        raise WireError(f"{where}: not a valid safetensors file ({e})") from e
    if "data" not in tensors:
        raise WireError(
            f"{where}: safetensors file must hold a tensor named 'data', has {sorted(tensors)}"
        )
    return tensors["data"]


def _str_list(obj: Any, where: str, allow_numbers: bool = False) -> list:
    if not isinstance(obj, list):
        raise WireError(f"{where}: expected a list, got {type(obj).__name__}")
    for i, v in enumerate(obj):
        ok = isinstance(v, str) or (
            allow_numbers and isinstance(v, int | float) and not isinstance(v, bool)
        )
        if not ok:
            raise WireError(f"{where}[{i}]: expected a string, got {type(v).__name__}")
    return obj


_KNOWN = {
    "images",
    "videos",
    "latents",
    "audio",
    "sample_rate",
    "texts",
    "prompts",
    "references",
    "metadata",
}


def encode_input(inp: RewardInput) -> dict[str, Any]:
    """A `RewardInput` as a JSON-able dict (images as PNG)."""
    out: dict[str, Any] = {}
    if inp.images is not None:
        out["images"] = [encode_png(im) for im in inp.image_list("http")]
    if inp.videos is not None:
        out["videos"] = [[encode_png(f) for f in v] for v in inp.video_list("http")]
    if inp.latents is not None:
        lat = inp.latents
        if isinstance(lat, list | tuple):
            lat = np.stack([as_numpy(x) for x in lat])
        out["latents"] = _encode_tensor(lat)
    if inp.audio is not None:
        waves = inp.audio_list("http")
        if len({len(w) for w in waves}) != 1:
            raise RewardInputError("audio: the wire format needs equal-length waveforms")
        out["audio"] = _encode_tensor(np.stack(waves))
        out["sample_rate"] = int(inp.sample_rate)  # type: ignore[arg-type]
    for name in ("texts", "prompts", "references"):
        v = getattr(inp, name)
        if v is not None:
            out[name] = list(v)
    if inp.metadata is not None:
        out["metadata"] = inp.metadata if isinstance(inp.metadata, dict) else list(inp.metadata)
    return out


def decode_input(obj: Any) -> RewardInput:
    """Inverse of `encode_input`; raises `WireError` / `RewardInputError` naming the field."""
    if not isinstance(obj, dict):
        raise WireError(f"request body: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _KNOWN
    if unknown:
        raise WireError(f"request body: unknown fields {sorted(unknown)}; known: {sorted(_KNOWN)}")
    kw: dict[str, Any] = {}
    if "images" in obj:
        imgs = obj["images"]
        if not isinstance(imgs, list):
            raise WireError("images: expected a list of base64 PNG/JPEG strings")
        kw["images"] = [_decode_image(s, f"images[{i}]") for i, s in enumerate(imgs)]
    if "videos" in obj:
        vids = obj["videos"]
        if not isinstance(vids, list) or not all(isinstance(v, list) and v for v in vids):
            raise WireError("videos: expected a list of non-empty lists of base64 PNG/JPEG frames")
        decoded = []
        for i, v in enumerate(vids):
            frames = [_decode_image(s, f"videos[{i}][{t}]") for t, s in enumerate(v)]
            if len({f.shape for f in frames}) != 1:
                raise WireError(f"videos[{i}]: frames differ in size")
            decoded.append(np.stack(frames))
        kw["videos"] = decoded
    if "latents" in obj:
        kw["latents"] = _decode_tensor(obj["latents"], "latents")
        if kw["latents"].ndim < 2:
            raise WireError(f"latents: expected a batch (B, ...), got shape {kw['latents'].shape}")
    if "audio" in obj:
        a = _decode_tensor(obj["audio"], "audio")
        if a.ndim not in (2, 3):
            raise WireError(f"audio: expected (B, N) or (B, C, N), got shape {a.shape}")
        kw["audio"] = a
        if obj.get("sample_rate") is None:
            raise WireError("sample_rate: required with audio (an integer, Hz)")
        kw["sample_rate"] = _sample_rate(obj["sample_rate"])
    elif obj.get("sample_rate") is not None:
        kw["sample_rate"] = _sample_rate(obj["sample_rate"])
    for name in ("texts", "prompts"):
        if name in obj:
            kw[name] = _str_list(obj[name], name)
    if "references" in obj:
        kw["references"] = _str_list(obj["references"], "references", allow_numbers=True)
    if "metadata" in obj:
        meta = obj["metadata"]
        if not isinstance(meta, dict | list):
            raise WireError("metadata: expected an object or a list of objects")
        kw["metadata"] = meta
    return RewardInput(**kw)
