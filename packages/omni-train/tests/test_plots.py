"""Sample grids: one block per prompt with its title wrapped over its samples, blocks filling
rows of at most 8 images, so validation over many prompts reads as a page."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from omni_train.plots import CHAR, LINE, prompt_grid, save_prompt_grid, score_labels


def _images(b: int, h: int = 32) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (b, h, h, 3), dtype=np.uint8)


def test_one_sample_per_prompt_fills_rows_of_eight() -> None:
    prompts = [f"prompt {i}" for i in range(19)]
    grid = prompt_grid(_images(19), prompts, per_prompt=1, labels=["1.00"] * 19, scale=3)
    block = 96 + 2
    assert grid.size == (8 * (block + 4) + 2, 3 * (LINE + 96 + LINE + 2 + 4) + 2)


def test_blocks_keep_their_samples_in_order_under_their_title() -> None:
    """The k-th sample of prompt g lands at block g's k-th tile, pixel for pixel."""
    images = _images(6)
    grid = np.asarray(prompt_grid(images, ["a", "b"], per_prompt=3, scale=1))
    block_w = 3 * (32 + 2)
    for g in range(2):
        for k in range(3):
            x, y = 2 + g * (block_w + 4) + k * 34, 2 + LINE
            assert (grid[y : y + 32, x : x + 32] == images[g * 3 + k]).all()


def test_long_prompts_wrap_to_the_block_width() -> None:
    """A prompt longer than one line of its block gets more title lines (all blocks align)."""
    long = "a yellow triangle right of a green square"
    short = prompt_grid(_images(2), ["a circle", "a square"], per_prompt=1, scale=3)
    wrapped = prompt_grid(_images(2), [long, "a square"], per_prompt=1, scale=3)
    lines = -(-len(long) // ((98 - 4) // CHAR))  # at least this many lines
    assert wrapped.size[0] == short.size[0]
    assert wrapped.size[1] - short.size[1] >= (lines - 1) * LINE


def test_mismatched_counts_name_them(tmp_path) -> None:
    with pytest.raises(ValueError, match="3 prompts x per_prompt 2 != 4 images"):
        prompt_grid(_images(4), ["a", "b", "c"], per_prompt=2)
    with pytest.raises(ValueError, match="prompt_grid: no prompts"):
        prompt_grid(_images(0), [], per_prompt=1)
    path = save_prompt_grid(_images(4), tmp_path / "g" / "grid.png", ["a", "b"], 2)
    assert Image.open(path).size[0] > 0


def test_a_verdict_reward_labels_samples_with_words() -> None:
    """The `shapes` reward's verdict reads as a word under each sample: "ok", or the first
    part that failed; a reward without a verdict keeps its score."""
    from omni_rewards import RewardInput
    from omni_rewards.shapes import ShapesReward, render

    images = np.stack(
        [
            np.asarray(render(c, seed=3))
            for c in ("a red circle", "a blue circle", "two red circles")
        ]
    )
    prompts = ["a red circle"] * 3
    out = ShapesReward()(RewardInput(images=images, prompts=prompts))
    assert score_labels(out.scores, out.details) == ["ok", "no: colour", "no: count"]
    assert score_labels(np.array([0.25, 1.0])) == ["0.25", "1.00"]
    # each label fits under a 96-pixel tile
    assert all(len(x) <= 96 // CHAR for x in score_labels(out.scores, out.details))
