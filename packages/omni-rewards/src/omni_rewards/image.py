"""Core image rewards that need only numpy and Pillow.

- ``jpeg_compressibility`` / ``jpeg_incompressibility`` (DDPO, Black et al. 2023,
  "Training Diffusion Models with Reinforcement Learning"): the size in kB of the image
  saved as JPEG at quality 95, negated for compressibility.
- ``brightness``: mean Rec. 601 luma in [0, 1].
- ``color_match``: how close the mean colour is to the palette colour the prompt names.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from .base import Reward
from .prompt_checks import register_prompt_check
from .registry import register
from .types import RewardInput, RewardInputError, RewardOutput

__all__ = [
    "PALETTE",
    "BrightnessReward",
    "ColorMatchReward",
    "JpegCompressibility",
    "JpegIncompressibility",
    "find_color",
    "jpeg_size_kb",
]

#: The fixed colour palette of ``color_match`` (sRGB, 0..255).
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "cyan": (0, 255, 255),
    "magenta": (255, 0, 255),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "orange": (255, 165, 0),
    "purple": (128, 0, 128),
}

_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float64)


def jpeg_size_kb(image: np.ndarray, quality: int = 95) -> float:
    """Size in kB (1000 bytes) of ``image`` (uint8 (H, W, 3)) encoded as JPEG at ``quality``."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=int(quality))
    return buf.tell() / 1000.0


class _Jpeg(Reward):
    sign: float = 1.0

    def __init__(self, *, quality: int = 95, batch_size: int | None = None, workers: int = 1):
        super().__init__(batch_size=batch_size, workers=workers)
        if not 1 <= int(quality) <= 100:
            raise ValueError(f"quality: must be in 1..100, got {quality}")
        self.quality = int(quality)

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        sizes = np.array(
            [jpeg_size_kb(im, self.quality) for im in inp.image_list(self.name)], dtype=np.float32
        )
        return RewardOutput(self.sign * sizes, {"jpeg_kb": sizes})


@register("jpeg_incompressibility")
class JpegIncompressibility(_Jpeg):
    """score = size_kB(JPEG(image, quality=95)). Inputs: ``images``."""

    name = "jpeg_incompressibility"
    sign = 1.0


@register("jpeg_compressibility")
class JpegCompressibility(_Jpeg):
    """score = -size_kB(JPEG(image, quality=95)). Inputs: ``images``."""

    name = "jpeg_compressibility"
    sign = -1.0


@register("brightness")
class BrightnessReward(Reward):
    """score = mean over pixels (and frames) of (0.299 R + 0.587 G + 0.114 B) / 255, in [0, 1].

    Inputs: ``images`` or ``videos``.
    """

    name = "brightness"

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        scores = [
            float(v.reshape(-1, 3).mean(axis=0) @ _LUMA) / 255.0 for v in inp.visual_list(self.name)
        ]
        return RewardOutput(np.array(scores, dtype=np.float32))


def find_color(prompt: str, palette: Mapping[str, Any] = PALETTE) -> str | None:
    """The palette colour named first in ``prompt`` (whole words, case-insensitive), or None."""
    names = sorted(palette, key=len, reverse=True)
    pattern = r"\b(" + "|".join(re.escape(n) for n in names) + r")\b"
    m = re.search(pattern, prompt, flags=re.IGNORECASE)
    return None if m is None else m.group(1).lower()


@register_prompt_check("color_match")
def _color_named(prompt: str, options: dict[str, Any]) -> str | None:
    if options.get("default_color") is not None:
        return None
    palette = options.get("palette") or PALETTE
    if find_color(prompt, palette) is None:
        return f"names no palette colour ({', '.join(palette)}); set default_color"
    return None


@register("color_match")
class ColorMatchReward(Reward):
    """score = 1 - ||mean_RGB(image) - palette_RGB(colour)||_2 / (255 sqrt(3)), in [0, 1].

    The colour is the first palette word (`PALETTE`: red, green, blue, yellow, cyan, magenta,
    white, black, orange, purple) in the sample's prompt. A prompt without one raises a
    ValueError naming its index, unless ``default_color`` (a palette name or an RGB triple)
    is given. Inputs: ``images`` or ``videos``, and ``prompts``. ``details["target_rgb"]``
    is the (B, 3) target, ``details["distance"]`` the normalised distance.
    """

    name = "color_match"

    def __init__(
        self,
        *,
        default_color: str | Sequence[int] | None = None,
        palette: Mapping[str, Sequence[int]] | None = None,
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, workers=workers)
        self.palette = {
            k.lower(): tuple(int(c) for c in v) for k, v in (palette or PALETTE).items()
        }
        for k, v in self.palette.items():
            if len(v) != 3 or not all(0 <= c <= 255 for c in v):
                raise ValueError(f"palette[{k!r}]: expected an RGB triple in 0..255, got {v}")
        self.default_rgb: tuple[int, int, int] | None = None
        if default_color is not None:
            if isinstance(default_color, str):
                if default_color.lower() not in self.palette:
                    raise ValueError(
                        f"default_color: {default_color!r} is not in the palette "
                        f"({', '.join(self.palette)})"
                    )
                self.default_rgb = self.palette[default_color.lower()]
            else:
                rgb = tuple(int(c) for c in default_color)
                if len(rgb) != 3 or not all(0 <= c <= 255 for c in rgb):
                    raise ValueError(
                        f"default_color: expected a colour name or RGB triple, got {default_color!r}"
                    )
                self.default_rgb = rgb  # type: ignore[assignment]

    def target_rgb(self, prompt: str, index: int) -> tuple[int, int, int]:
        color = find_color(prompt, self.palette)
        if color is not None:
            return self.palette[color]  # type: ignore[return-value]
        if self.default_rgb is not None:
            return self.default_rgb
        raise RewardInputError(
            f"prompts[{index}]: no palette colour ({', '.join(self.palette)}) in prompt "
            f"{prompt!r}; pass default_color= to score such prompts"
        )

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        visuals = inp.visual_list(self.name)
        prompts = inp.prompt_list(self.name)
        targets = np.array([self.target_rgb(p, i) for i, p in enumerate(prompts)], dtype=np.float64)
        means = np.stack([v.reshape(-1, 3).mean(axis=0) for v in visuals])
        dist = np.linalg.norm(means - targets, axis=1) / (255.0 * math.sqrt(3.0))
        return RewardOutput(
            (1.0 - dist).astype(np.float32),
            {"distance": dist.astype(np.float32), "target_rgb": targets.astype(np.float32)},
        )
