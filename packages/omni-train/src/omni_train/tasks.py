"""Visual question data for the omni (autoregressive) path: generated tasks and JSONL files.

An `OmniItem` is one question: a prompt, an optional image (uint8 (H, W, 3)) and the reference
answer the reward compares against (a choice letter, a number, an expression).

Generated task ``shapes`` (the CPU twin's task, learnable by a tiny random model): an image of
``k`` white shapes (squares, circles, triangles; ``k`` in 1..4, drawn without overlap on a
black canvas with PIL) and the question :data:`SHAPES_QUESTION`; the answer is the letter of
``k`` (A = 1 ... D = 4). Item ``i`` of a split is a pure function of (seed, split, i), and the
held-out validation split uses a different seed domain and exactly equal class counts, so chance
accuracy on it is 0.25.

JSONL files (the MMK12 fields, one row per question): one object per line with ``prompt``
(the question), ``answer`` (the reference) and optionally ``image`` (a PNG/JPEG path relative
to the file's folder). Bad rows are reported by file and line number, as in
`omni_train.data` (UTF-8 only, prompts up to `omni_train.data.MAX_PROMPT_CHARS` characters).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .data import check_prompt, data_file, read_jsonl_rows
from .recipe import RecipeError
from .seeds import derive_seed

__all__ = [
    "CHOICE_LETTERS",
    "SHAPES_QUESTION",
    "TASKS",
    "OmniItem",
    "first_choice_letter",
    "read_omni_file",
    "render_shapes",
    "shapes_task",
]

SHAPES_QUESTION = "How many shapes? Answer with a letter: A) 1 B) 2 C) 3 D) 4"
CHOICE_LETTERS = "ABCD"

#: seed domains of the generated splits (kept apart from the trainer's own domains 0..3)
_DOMAIN_TASK_TRAIN = 11
_DOMAIN_TASK_VAL = 12


@dataclass
class OmniItem:
    """One question: `prompt`, optional `image` (uint8 (H, W, 3)) and the reference `answer`."""

    prompt: str
    answer: str
    image: np.ndarray | None = None

    def content(self) -> list[dict[str, Any]] | str:
        """The chat content parts for `ThinkerAdapter.build_batch` (image first, then text)."""
        if self.image is None:
            return self.prompt
        return [{"type": "image"}, {"type": "text", "text": self.prompt}]


def render_shapes(k: int, seed: int, size: int = 32) -> np.ndarray:
    """An RGB uint8 (size, size, 3) image of `k` non-overlapping white shapes on black.

    Each shape is a square, circle or triangle of side ~size/4 in its own cell of a 3 x 3 grid
    (cells drawn without replacement, a small random offset inside the cell), so shapes never
    touch and the count is unambiguous. Deterministic in (k, seed, size).
    """
    from PIL import Image, ImageDraw

    if not 1 <= k <= 9:
        raise ValueError(f"k: between 1 and 9 shapes fit the 3 x 3 grid, got {k}")
    if size < 12:
        raise ValueError(f"size: at least 12 pixels, got {size}")
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (size, size), (0, 0, 0))
    draw = ImageDraw.Draw(img)
    cell = size // 3
    side = max(3, int(cell * 0.7))
    for c in rng.choice(9, size=k, replace=False):
        r, q = divmod(int(c), 3)
        slack = cell - side
        x0 = q * cell + int(rng.integers(0, slack + 1))
        y0 = r * cell + int(rng.integers(0, slack + 1))
        x1, y1 = x0 + side - 1, y0 + side - 1
        kind = int(rng.integers(0, 3))
        if kind == 0:
            draw.rectangle([x0, y0, x1, y1], fill=(255, 255, 255))
        elif kind == 1:
            draw.ellipse([x0, y0, x1, y1], fill=(255, 255, 255))
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=(255, 255, 255))
    return np.asarray(img, dtype=np.uint8).copy()


def shapes_task(
    split: str, size: int, seed: int = 0, image_size: int = 32, max_shapes: int = 4
) -> list[OmniItem]:
    """`size` items of the shape-counting task for `split` ("train" or "val").

    The answer letters are balanced: item i has k = 1 + (i mod max_shapes) shapes before a
    seeded shuffle, so every class appears size / max_shapes times (exactly, when it divides).
    """
    if split not in ("train", "val"):
        raise ValueError(f"split: 'train' or 'val', got {split!r}")
    if not 1 <= max_shapes <= len(CHOICE_LETTERS):
        raise ValueError(f"max_shapes: between 1 and {len(CHOICE_LETTERS)}, got {max_shapes}")
    domain = _DOMAIN_TASK_TRAIN if split == "train" else _DOMAIN_TASK_VAL
    order = np.random.default_rng(derive_seed(seed, 0, 0, domain)).permutation(size)
    items = []
    for i in range(size):
        k = 1 + int(order[i]) % max_shapes
        img = render_shapes(k, derive_seed(seed, 1, i, domain), image_size)
        items.append(OmniItem(SHAPES_QUESTION, CHOICE_LETTERS[k - 1], img))
    return items


#: generated tasks: name -> fn(split, size, seed, **options) -> list[OmniItem]
TASKS: dict[str, Callable[..., list[OmniItem]]] = {"shapes": shapes_task}


def first_choice_letter(text: str, letters: str = CHOICE_LETTERS) -> str:
    """The first capital letter of `letters` in `text` that stands alone, or "".

    "Standing alone" means not inside a word: the characters around it are not letters
    ("B", " B.", "(B)" and "1B" count; "Bob" and "aB" do not). Short
    choice answers are read this way when `reward.extract` is `first_letter`.
    """
    m = re.search(rf"(?<![A-Za-z])([{letters}])(?![A-Za-z])", text)
    return m.group(1) if m else ""


def read_omni_file(path: str | Path, key: str = "data.file") -> list[OmniItem]:
    """Items from a JSONL file of {"prompt", "answer", "image"?} rows (MMK12 format)."""
    p = data_file(path, key)
    items = []
    for row in read_jsonl_rows(p, key):
        answer = row.fields.get("answer")
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) or not answer.strip():
            raise RecipeError(f"{row.where}: needs a non-empty 'answer' field")
        check_prompt(answer, row.where, "answer")
        image = None if row.image is None else row.image.load()
        items.append(OmniItem(row.prompt, answer, image))
    if not items:
        raise RecipeError(f"{key} {p}: no rows")
    return items


def load_items(
    task: str | None,
    file: str | None,
    split: str,
    size: int,
    seed: int,
    options: dict[str, Any],
    key: str,
) -> list[OmniItem]:
    """A generated task's split or a file's rows, with errors naming `key`."""
    if file is not None:
        return read_omni_file(file, key)
    if task not in TASKS:
        raise RecipeError(f"data.task: unknown task {task!r}; known: {', '.join(sorted(TASKS))}")
    try:
        return TASKS[task](split, size, seed, **options)
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"data.task_options: {exc}") from None
