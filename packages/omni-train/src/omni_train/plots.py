"""Pictures a run writes: the reward curve and sample grids (PNG, matplotlib Agg / PIL)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw


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
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def image_grid(
    images: np.ndarray,
    cols: int,
    labels: list[str] | None = None,
    scale: int = 1,
    row_labels: list[str] | None = None,
) -> Image.Image:
    """Tile uint8 images (B, H, W, 3) into a grid with an optional caption under each and an
    optional title line above each row (e.g. the prompt of a group)."""
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"image_grid: expected (B, H, W, 3) uint8, got shape {images.shape}")
    b, h, w, _ = images.shape
    cols = max(1, min(cols, b))
    rows = math.ceil(b / cols)
    cap = 12 if labels else 0
    head = 12 if row_labels else 0
    hs, ws = h * scale, w * scale
    width = cols * (ws + 2) + 2
    grid = Image.new("RGB", (width, rows * (head + hs + cap + 2) + 2), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for r in range(rows if row_labels else 0):
        if r < len(row_labels):  # type: ignore[arg-type]
            text = row_labels[r][: max(8, width // 6)]  # type: ignore[index]
            draw.text((3, 2 + r * (head + hs + cap + 2)), text, fill=(0, 0, 128))
    for i in range(b):
        r, c = divmod(i, cols)
        x, y = 2 + c * (ws + 2), 2 + r * (head + hs + cap + 2) + head
        tile = Image.fromarray(images[i].astype(np.uint8))
        if scale != 1:
            tile = tile.resize((ws, hs), Image.NEAREST)
        grid.paste(tile, (x, y))
        if labels:
            draw.text((x + 1, y + hs), labels[i][: max(4, ws // 6)], fill=(0, 0, 0))
    return grid


def save_sample_grid(
    images: np.ndarray,
    path: str | Path,
    cols: int,
    labels: list[str] | None = None,
    row_labels: list[str] | None = None,
) -> Path:
    """Write `image_grid(...)` as a PNG (small images are upscaled so they are visible)."""
    h = int(np.asarray(images).shape[1])
    scale = max(1, 96 // max(h, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, cols, labels, scale=scale, row_labels=row_labels).save(out)
    return out


def save_frame_strip(frames: np.ndarray, path: str | Path, max_frames: int = 8) -> Path:
    """A video's frames left to right (at most `max_frames`, evenly spaced) as one PNG."""
    f = np.asarray(frames)
    idx = np.linspace(0, f.shape[0] - 1, min(max_frames, f.shape[0])).round().astype(int)
    h = int(f.shape[1])
    scale = max(1, 64 // max(h, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
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
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
