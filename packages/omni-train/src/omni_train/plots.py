"""Pictures a run writes: the reward curve and sample grids (PNG, matplotlib Agg / PIL)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from omni_rewards.shapes import VERDICT_PARTS

# PIL's default bitmap font: ~6 pixels per character, 11 per line (+1 spacing)
CHAR, LINE = 6, 12
WHITE = (255, 255, 255)


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` (its folder made if missing) and free it: pyplot
    keeps every open figure until closed, and a long run draws one per plot."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_reward_curve(
    rows: list[dict[str, Any]],
    path: str | Path,
    title: str = "",
    val_label: str = "val reward (ODE)",
) -> Path:
    """Reward mean per step (with a +-std band) and the validation reward when logged
    (`val_label`: how validation samples, ODE for diffusion, greedy for the omni path)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    train = [r for r in rows if "reward/mean" in r]
    val = [r for r in rows if "val/reward_mean" in r]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    if train:
        steps = np.array([r["step"] for r in train])
        mean = np.array([r["reward/mean"] for r in train], dtype=float)
        std = np.array([r.get("reward/std", 0.0) for r in train], dtype=float)
        ax.plot(steps, mean, marker="o", ms=3, label="train reward mean")
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
    if val:
        ax.plot(
            [r["step"] for r in val],
            [r["val/reward_mean"] for r in val],
            marker="s",
            ms=4,
            label=val_label,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(title or "reward")
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend(loc="best", fontsize=8)
    return save_figure(fig, path)


def score_labels(scores: np.ndarray, details: dict[str, Any] | None = None) -> list[str]:
    """A caption for each sample of a grid: the verdict in a word when the reward gives one
    (a ``correct`` detail, as the `shapes` reward gives: "ok", else "no: " and the first failed
    part of `omni_rewards.shapes.VERDICT_PARTS`, e.g. "no: colour"), else the score with two
    decimals."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    details = details or {}
    if "correct" not in details:
        return [f"{s:.2f}" for s in scores]
    correct = np.asarray(details["correct"], dtype=np.float64).reshape(-1)
    parts = {k: np.asarray(details[k], dtype=np.float64).reshape(-1)
             for k in VERDICT_PARTS if k in details}  # fmt: skip
    labels = []
    for i, ok in enumerate(correct):
        if ok == 1.0:
            labels.append("ok")
            continue
        failed = next((k for k, v in parts.items() if v[i] == 0.0), None)
        labels.append(f"no: {failed}" if failed else "no")
    return labels


def image_grid(
    images: np.ndarray,
    cols: int,
    labels: list[str] | None = None,
    scale: int = 1,
) -> Image.Image:
    """Tile uint8 images (B, H, W, 3) into a grid with an optional caption under each."""
    images = _check_images(images)
    b, h, w, _ = images.shape
    cols = max(1, min(cols, b))
    rows = math.ceil(b / cols)
    cap = LINE if labels else 0
    hs, ws = h * scale, w * scale
    grid = Image.new("RGB", (cols * (ws + 2) + 2, rows * (hs + cap + 2) + 2), WHITE)
    draw = ImageDraw.Draw(grid)
    for i in range(b):
        r, c = divmod(i, cols)
        x, y = 2 + c * (ws + 2), 2 + r * (hs + cap + 2)
        _paste(grid, images[i], x, y, scale)
        if labels:
            draw.text((x + 1, y + hs), labels[i][: max(4, ws // CHAR)], fill=(0, 0, 0))
    return grid


def prompt_grid(
    images: np.ndarray,
    prompts: list[str],
    per_prompt: int,
    labels: list[str] | None = None,
    scale: int = 1,
    max_cols: int = 8,
) -> Image.Image:
    """One block per prompt: the prompt, wrapped to the block's width, above its `per_prompt`
    samples (images ``i * per_prompt ... (i + 1) * per_prompt - 1``), each captioned with its
    label (e.g. the reward). Blocks fill rows of at most `max_cols` images (at least one block
    per row), so many prompts with one sample each make a readable page, not one column."""
    images = _check_images(images)
    b, h, w, _ = images.shape
    if not prompts:
        raise ValueError("prompt_grid: no prompts (nothing to draw)")
    if per_prompt < 1 or len(prompts) * per_prompt != b:
        raise ValueError(
            f"prompt_grid: {len(prompts)} prompts x per_prompt {per_prompt} != {b} images"
        )
    hs, ws = h * scale, w * scale
    per_row = max(1, max_cols // per_prompt)  # blocks per row
    block_w = per_prompt * (ws + 2)
    chars = max(8, (block_w - 4) // CHAR)
    titles = [textwrap.wrap(p, chars)[:4] or [""] for p in prompts]
    head = LINE * max(len(t) for t in titles)
    cap = LINE if labels else 0
    rows = math.ceil(len(prompts) / per_row)
    row_h = head + hs + cap + 2
    grid = Image.new(
        "RGB", (min(per_row, len(prompts)) * (block_w + 4) + 2, rows * (row_h + 4) + 2), WHITE
    )
    draw = ImageDraw.Draw(grid)
    for g, title in enumerate(titles):
        r, c = divmod(g, per_row)
        x0, y0 = 2 + c * (block_w + 4), 2 + r * (row_h + 4)
        draw.text((x0 + 1, y0), "\n".join(title), fill=(0, 0, 128), spacing=1)
        for k in range(per_prompt):
            i = g * per_prompt + k
            x, y = x0 + k * (ws + 2), y0 + head
            _paste(grid, images[i], x, y, scale)
            if labels:
                draw.text((x + 1, y + hs), labels[i][: max(4, ws // CHAR)], fill=(0, 0, 0))
    return grid


def _check_images(images: np.ndarray) -> np.ndarray:
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"image grid: expected (B, H, W, 3) uint8, got shape {images.shape}")
    return images


def _paste(grid: Image.Image, image: np.ndarray, x: int, y: int, scale: int) -> None:
    tile = Image.fromarray(image.astype(np.uint8))
    if scale != 1:
        tile = tile.resize((tile.width * scale, tile.height * scale), Image.NEAREST)
    grid.paste(tile, (x, y))


def _display_scale(images: np.ndarray, target: int) -> int:
    """Small images are upscaled (nearest) so that they are visible: to about `target` px."""
    return max(1, target // max(int(np.asarray(images).shape[1]), 1))


def save_sample_grid(
    images: np.ndarray,
    path: str | Path,
    cols: int,
    labels: list[str] | None = None,
) -> Path:
    """Write `image_grid(...)` as a PNG (small images are upscaled so they are visible)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, cols, labels, scale=_display_scale(images, 96)).save(out)
    return out


def save_prompt_grid(
    images: np.ndarray,
    path: str | Path,
    prompts: list[str],
    per_prompt: int,
    labels: list[str] | None = None,
) -> Path:
    """Write `prompt_grid(...)` as a PNG (small images are upscaled so they are visible)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    grid = prompt_grid(images, prompts, per_prompt, labels, scale=_display_scale(images, 96))
    grid.save(out)
    return out


def save_frame_strip(frames: np.ndarray, path: str | Path, max_frames: int = 8) -> Path:
    """A video's frames left to right (at most `max_frames`, evenly spaced) as one PNG."""
    f = np.asarray(frames)
    idx = np.linspace(0, f.shape[0] - 1, min(max_frames, f.shape[0])).round().astype(int)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    scale = _display_scale(f, 64)
    image_grid(f[idx], cols=len(idx), labels=[f"t{i}" for i in idx], scale=scale).save(out)
    return out


def save_waveform_plot(waveform: np.ndarray, sample_rate: int, path: str | Path) -> Path:
    """One sample's waveform, `(channels, samples)` or `(samples,)`, plotted against seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = np.atleast_2d(np.asarray(waveform, dtype=np.float32))
    t = np.arange(w.shape[1]) / float(sample_rate)
    fig, ax = plt.subplots(figsize=(6, 2.2), dpi=100)
    for c, ch in enumerate(w):
        ax.plot(t, ch, linewidth=0.6, label=f"channel {c}")
    ax.set_xlabel("seconds")
    ax.set_ylim(-1.05, 1.05)
    if len(w) > 1:
        ax.legend(loc="upper right", fontsize=7)
    return save_figure(fig, path)
