"""Inputs and outputs of every reward: `RewardInput` and `RewardOutput`.

Only numpy and Pillow are needed here. Torch tensors are accepted by duck typing (anything
with ``.detach().cpu().numpy()``), so torch is never imported by the core.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

__all__ = [
    "RewardInput",
    "RewardInputError",
    "RewardOutput",
    "as_numpy",
    "to_uint8_image",
]

# Fields that carry one entry per sample; they are sliced together when a reward batches.
BATCH_FIELDS = ("images", "videos", "audio", "latents", "texts", "prompts", "references")


class RewardInputError(ValueError):
    """A `RewardInput` field is missing, has the wrong shape, or the wrong length."""


def as_numpy(x: Any) -> np.ndarray:
    """Convert a numpy array, torch tensor (duck-typed), PIL image or nested list to numpy."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, Image.Image):
        return np.asarray(x.convert("RGB"))
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        t = x.detach().cpu()
        if str(getattr(t, "dtype", "")) == "torch.bfloat16":
            t = t.float()
        return t.numpy()
    return np.asarray(x)


def to_uint8_image(x: Any, *, field: str = "images", index: int = 0) -> np.ndarray:
    """One image as a uint8 array of shape (H, W, 3).

    Accepts PIL images, uint8 arrays (H, W, 3) / (H, W) / (H, W, 4), channels-first
    (3, H, W) arrays, and float arrays with values in [0, 1] (scaled by 255 and rounded).
    Anything else raises `RewardInputError` naming ``field[index]``.
    """
    where = f"{field}[{index}]"
    if isinstance(x, Image.Image):
        return np.asarray(x.convert("RGB"), dtype=np.uint8)
    a = as_numpy(x)
    if a.ndim == 3 and a.shape[0] in (1, 3, 4) and a.shape[-1] not in (1, 3, 4):
        a = np.moveaxis(a, 0, -1)
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in (1, 3, 4):
        raise RewardInputError(
            f"{where}: expected an image of shape (H, W, 3) (or a PIL image), got shape {a.shape}"
        )
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise RewardInputError(f"{where}: image has zero size {a.shape}")
    if a.dtype == np.uint8:
        pass
    elif np.issubdtype(a.dtype, np.floating):
        if not np.all(np.isfinite(a)):
            raise RewardInputError(f"{where}: float image contains NaN or inf")
        lo, hi = float(a.min()), float(a.max())
        if lo < -1e-3 or hi > 1 + 1e-3:
            raise RewardInputError(
                f"{where}: float images must lie in [0, 1], got range [{lo:.3g}, {hi:.3g}]; "
                "pass uint8 for 0..255 data"
            )
        a = np.clip(np.rint(a * 255.0), 0, 255).astype(np.uint8)
    elif np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi > 255:
            raise RewardInputError(f"{where}: integer image values must be 0..255, got {lo}..{hi}")
        a = a.astype(np.uint8)
    else:
        raise RewardInputError(f"{where}: unsupported image dtype {a.dtype}")
    if a.shape[-1] == 1:
        a = np.repeat(a, 3, axis=-1)
    elif a.shape[-1] == 4:
        a = a[..., :3]
    return np.ascontiguousarray(a)


def _length(name: str, value: Any) -> int:
    if isinstance(value, str):
        raise RewardInputError(f"{name}: expected a list with one entry per sample, got a str")
    if isinstance(value, Image.Image):
        raise RewardInputError(f"{name}: expected a list of PIL images, got a single PIL image")
    if hasattr(value, "shape") and not isinstance(value, list | tuple):
        shape = tuple(value.shape)
        if len(shape) == 0:
            raise RewardInputError(f"{name}: expected a batch (first dim = samples), got a scalar")
        return int(shape[0])
    try:
        return len(value)
    except TypeError as e:
        raise RewardInputError(f"{name}: expected a sequence or array, got {type(value)}") from e


def _slice(value: Any, start: int, stop: int) -> Any:
    if value is None:
        return None
    return value[start:stop]


@dataclass
class RewardInput:
    """What a reward scores. Every field but ``sample_rate`` and dict-``metadata`` is per sample.

    - ``images``: uint8 (B, H, W, 3) numpy/torch, a list of PIL images or of (H, W, 3) arrays.
    - ``videos``: (B, T, H, W, 3) uint8, or a list of (T, H, W, 3) arrays.
    - ``audio``: (B, N) or (B, C, N) float waveforms in [-1, 1], or a list of 1-D/2-D arrays;
      ``sample_rate`` (Hz) is required with audio.
    - ``latents``: (B, ...) float arrays/tensors (clean diffusion latents).
    - ``texts``: generated text (for text rewards such as ``math``).
    - ``prompts``: the conditioning prompt of each sample.
    - ``references``: per-sample ground truth (target OCR text, the correct answer, ...).
    - ``metadata``: a list with one dict per sample, or one dict shared by all samples.
    """

    images: Any = None
    videos: Any = None
    audio: Any = None
    sample_rate: int | None = None
    latents: Any = None
    texts: Sequence[str] | None = None
    prompts: Sequence[str] | None = None
    references: Sequence[Any] | None = None
    metadata: Any = None

    def __post_init__(self) -> None:
        self.batch_size  # noqa: B018 - validates lengths eagerly
        if self.audio is not None and self.sample_rate is None:
            raise RewardInputError("sample_rate: required when audio is given")
        if self.sample_rate is not None and int(self.sample_rate) <= 0:
            raise RewardInputError(f"sample_rate: must be positive, got {self.sample_rate}")

    def present(self) -> list[str]:
        """Names of the per-sample fields that are set."""
        return [f for f in BATCH_FIELDS if getattr(self, f) is not None]

    @property
    def batch_size(self) -> int:
        """Number of samples; every per-sample field must agree on it."""
        lengths: dict[str, int] = {}
        for name in BATCH_FIELDS:
            value = getattr(self, name)
            if value is not None:
                lengths[name] = _length(name, value)
        if isinstance(self.metadata, list | tuple):
            lengths["metadata"] = len(self.metadata)
        if not lengths:
            return 0
        sizes = set(lengths.values())
        if len(sizes) > 1:
            desc = ", ".join(f"{k}={v}" for k, v in lengths.items())
            raise RewardInputError(f"fields disagree on the batch size: {desc}")
        return sizes.pop()

    def __len__(self) -> int:
        return self.batch_size

    def slice(self, start: int, stop: int) -> RewardInput:
        """Samples ``start:stop`` of every per-sample field (dict metadata is shared)."""
        kwargs: dict[str, Any] = {
            name: _slice(getattr(self, name), start, stop) for name in BATCH_FIELDS
        }
        meta = self.metadata
        if isinstance(meta, list | tuple):
            meta = list(meta[start:stop])
        return RewardInput(sample_rate=self.sample_rate, metadata=meta, **kwargs)

    def replace(self, **changes: Any) -> RewardInput:
        return dataclasses.replace(self, **changes)

    # ---- typed accessors used by rewards: they raise an error naming the field ----

    def require(self, name: str, reward: str = "this reward") -> Any:
        value = getattr(self, name)
        if value is None:
            have = ", ".join(self.present()) or "nothing"
            raise RewardInputError(f"{name}: {reward} needs `{name}` but the input has {have}")
        if self.batch_size == 0:
            raise RewardInputError(f"{name}: {reward} got an empty batch")
        return value

    def image_list(self, reward: str = "this reward") -> list[np.ndarray]:
        """The images as a list of uint8 (H, W, 3) arrays."""
        if self.images is None and self.videos is not None:
            raise RewardInputError(
                f"images: {reward} scores images only, but the input has videos; "
                "pass frames as `images` if that is what you mean"
            )
        imgs = self.require("images", reward)
        if isinstance(imgs, list | tuple):
            return [to_uint8_image(im, index=i) for i, im in enumerate(imgs)]
        arr = as_numpy(imgs)
        if arr.ndim != 4:
            raise RewardInputError(
                f"images: expected a batch of shape (B, H, W, 3), got shape {arr.shape}"
            )
        return [to_uint8_image(arr[i], index=i) for i in range(arr.shape[0])]

    def video_list(self, reward: str = "this reward") -> list[np.ndarray]:
        """The videos as a list of uint8 (T, H, W, 3) arrays."""
        vids = self.require("videos", reward)
        out = []
        items = vids if isinstance(vids, list | tuple) else list(as_numpy(vids))
        for i, v in enumerate(items):
            if isinstance(v, list | tuple):
                frames = [to_uint8_image(f, field=f"videos[{i}]", index=t) for t, f in enumerate(v)]
            else:
                a = as_numpy(v)
                if a.ndim != 4:
                    raise RewardInputError(
                        f"videos[{i}]: expected shape (T, H, W, 3), got shape {a.shape}"
                    )
                frames = [
                    to_uint8_image(a[t], field=f"videos[{i}]", index=t) for t in range(len(a))
                ]
            if not frames:
                raise RewardInputError(f"videos[{i}]: video has no frames")
            out.append(np.stack(frames))
        return out

    def visual_list(self, reward: str = "this reward") -> list[np.ndarray]:
        """Images as (1, H, W, 3) or videos as (T, H, W, 3): one frame stack per sample."""
        if self.images is not None:
            return [im[None] for im in self.image_list(reward)]
        if self.videos is not None:
            return self.video_list(reward)
        have = ", ".join(self.present()) or "nothing"
        raise RewardInputError(
            f"images: {reward} needs `images` or `videos` but the input has {have}"
        )

    def prompt_list(self, reward: str = "this reward") -> list[str]:
        prompts = self.require("prompts", reward)
        out = []
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise RewardInputError(f"prompts[{i}]: expected str, got {type(p).__name__}")
            out.append(p)
        return out

    def text_list(self, reward: str = "this reward") -> list[str]:
        texts = self.require("texts", reward)
        out = []
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise RewardInputError(f"texts[{i}]: expected str, got {type(t).__name__}")
            out.append(t)
        return out

    def audio_list(self, reward: str = "this reward") -> list[np.ndarray]:
        """The audio as a list of float32 mono waveforms (channels averaged)."""
        audio = self.require("audio", reward)
        items = audio if isinstance(audio, list | tuple) else list(as_numpy(audio))
        out = []
        for i, a in enumerate(items):
            w = as_numpy(a).astype(np.float32)
            if w.ndim == 2:
                w = w.mean(axis=0) if w.shape[0] <= 8 else w.mean(axis=1)
            if w.ndim != 1 or w.size == 0:
                raise RewardInputError(
                    f"audio[{i}]: expected a waveform (N,) or (C, N), got {w.shape}"
                )
            if not np.all(np.isfinite(w)):
                raise RewardInputError(f"audio[{i}]: waveform contains NaN or inf")
            out.append(w)
        return out

    def metadata_for(self, i: int) -> dict[str, Any]:
        if self.metadata is None:
            return {}
        if isinstance(self.metadata, dict):
            return self.metadata
        return dict(self.metadata[i])


@dataclass
class RewardOutput:
    """Scores (float32, shape (B,)) and per-sample details (name -> array of shape (B,))."""

    scores: np.ndarray
    details: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.scores = np.asarray(self.scores, dtype=np.float32).reshape(-1)
        fixed = {}
        for k, v in self.details.items():
            arr = np.asarray(v)
            if arr.shape[:1] != self.scores.shape:
                raise ValueError(
                    f"details[{k!r}]: expected {self.scores.shape[0]} entries, got shape {arr.shape}"
                )
            fixed[k] = arr
        self.details = fixed

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    @staticmethod
    def concat(outputs: Sequence[RewardOutput]) -> RewardOutput:
        if not outputs:
            return RewardOutput(np.zeros((0,), np.float32), {})
        if len(outputs) == 1:
            return outputs[0]
        keys = list(outputs[0].details)
        details = {}
        for k in keys:
            parts = [o.details[k] for o in outputs if k in o.details]
            if len(parts) == len(outputs):
                details[k] = np.concatenate(parts, axis=0)
        return RewardOutput(np.concatenate([o.scores for o in outputs]), details)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able dict (NaN becomes None)."""

        def clean(a: np.ndarray) -> list:
            if a.dtype.kind in "fc":
                return [None if not np.isfinite(x) else float(x) for x in a.tolist()]
            return a.tolist()

        return {
            "scores": clean(self.scores),
            "details": {
                k: clean(v) if v.ndim == 1 else v.tolist() for k, v in self.details.items()
            },
        }

    @staticmethod
    def from_json(obj: dict[str, Any]) -> RewardOutput:
        scores = np.array([np.nan if s is None else s for s in obj["scores"]], dtype=np.float32)
        details = {}
        for k, v in obj.get("details", {}).items():
            try:
                details[k] = np.array([np.nan if x is None else x for x in v])
            except (TypeError, ValueError):
                details[k] = np.array(v, dtype=object)
        return RewardOutput(scores, details)
