"""A synthetic captioned world of coloured shapes, and the ``shapes`` reward that checks it.

The world is small enough for a text-to-image model trained from scratch on two CPU cores, and
its captions follow the task types of GenEval (Ghosh et al. 2023, "GenEval: An Object-Focused
Framework for Evaluating Text-to-Image Alignment"): single object, two objects, counting,
colours, position and colour attribution. Everything here needs only numpy and Pillow.

Grammar (words separated by single spaces, lower case)::

    caption  := single | two | position | counting
    single   := "a" object                         "a circle", "a red circle"
    two      := "a" object "and a" object          "a red circle and a blue square"
    position := "a" object relation "a" object     "a red circle left of a blue square"
    counting := number [colour] plural             "three triangles", "two green crosses"
    object   := [colour] shape
    colour   := red | green | blue | yellow | black                    (`COLORS`)
    shape    := circle | square | triangle | cross                     (`SHAPES`)
    plural   := circles | squares | triangles | crosses
    number   := two | three | four                                     (`NUMBERS`)
    relation := "left of" | "right of" | "above" | "below"             (`RELATIONS`)

The two objects of ``two`` and ``position`` have different shapes. An object without a colour
may be drawn in any colour. The task type (`TASKS`) follows from the form: ``single`` is
``single_object`` without a colour and ``colors`` with one; ``two`` is ``color_attr`` when both
objects have a colour and ``two_object`` otherwise; ``counting``; ``position``.

An image shows exactly the objects its caption names, on a white background, each object a
flat palette colour, no two objects touching (`render`). "A left of B" means the centroid of A
is left of B's and the horizontal offset is larger than the vertical one (GenEval also judges
position from the objects' centres); above/below likewise.

Splits by composition (`split_of`): a caption is held out when it names a colour-shape pair of
`HELD_OUT_PAIRS`, counts a shape as in `HELD_OUT_COUNTS`, or relates two shapes as in
`HELD_OUT_RELATIONS`; every other caption is in the train split. So a model trained on the
train split never saw, e.g., a red triangle, three triangles, or a circle above a square.

The reward (`ShapesReward`, registered as ``shapes``) segments the image by nearest palette
colour (within a tolerance), takes the connected components of each colour as objects, names
each object's shape by the drawn shape it overlaps best (intersection over union, tolerant of
a ragged outline), and scores 1 when the objects are exactly those of the caption (shapes,
count, colours, position), else 0, as GenEval scores. Its details give each part separately.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .base import Reward
from .prompt_checks import register_prompt_check
from .types import RewardInput, RewardInputError, RewardOutput

__all__ = [
    "BACKGROUND",
    "COLORS",
    "HELD_OUT_COUNTS",
    "HELD_OUT_PAIRS",
    "HELD_OUT_RELATIONS",
    "NUMBERS",
    "RELATIONS",
    "SHAPES",
    "TASKS",
    "VERDICT_PARTS",
    "Caption",
    "CaptionError",
    "DetectedObject",
    "ObjectSpec",
    "ShapesReward",
    "all_captions",
    "check_image",
    "detect_objects",
    "format_caption",
    "parse_caption",
    "render",
    "sample_caption",
    "split_of",
    "task_types",
    "vocabulary",
    "write_splits",
]

#: palette (sRGB); pairwise distances are at least 140, so a tolerance of 60 is unambiguous
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 205, 25),
    "black": (20, 20, 20),
}
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
PLURALS: dict[str, str] = {"circle": "circles", "square": "squares", "triangle": "triangles",
                           "cross": "crosses"}  # fmt: skip
NUMBERS: dict[str, int] = {"two": 2, "three": 3, "four": 4}
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
TASKS: tuple[str, ...] = (
    "single_object",
    "two_object",
    "counting",
    "colors",
    "position",
    "color_attr",
)
#: the 0/1 parts of a verdict (`check_image`), each needing the ones before it: the first
#: that fails says what went wrong
VERDICT_PARTS: tuple[str, ...] = ("count", "object", "colour", "position")

#: colour-shape pairs no train caption names (each colour and shape at most once)
HELD_OUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    {("red", "triangle"), ("green", "circle"), ("blue", "cross"), ("yellow", "square")}
)
#: (count, shape) combinations no train caption asks for
HELD_OUT_COUNTS: frozenset[tuple[int, str]] = frozenset(
    {(2, "cross"), (3, "triangle"), (4, "square")}
)
#: (shape A, relation, shape B) of "a A relation a B" that no train caption uses
HELD_OUT_RELATIONS: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("circle", "above", "square"),
        ("triangle", "left of", "cross"),
        ("square", "below", "triangle"),
        ("cross", "right of", "circle"),
    }
)


class CaptionError(RewardInputError):
    """A caption outside the grammar (the message names the caption and the problem)."""


@dataclass(frozen=True)
class ObjectSpec:
    """One object of a caption: its shape and its colour (None: any colour)."""

    shape: str
    color: str | None = None


@dataclass(frozen=True)
class Caption:
    """A parsed caption: the objects (one spec per object, so counting repeats it), the
    relation between objects[0] and objects[1] for position captions, and the task type."""

    objects: tuple[ObjectSpec, ...]
    relation: str | None
    task: str
    form: str  # single | two | position | counting


# ------------------------------------------------------------------ grammar
def _object_words(spec: ObjectSpec) -> str:
    return spec.shape if spec.color is None else f"{spec.color} {spec.shape}"


def format_caption(caption: Caption) -> str:
    """The caption's text (the inverse of `parse_caption`)."""
    objs = caption.objects
    if caption.form == "single":
        return f"a {_object_words(objs[0])}"
    if caption.form == "two":
        return f"a {_object_words(objs[0])} and a {_object_words(objs[1])}"
    if caption.form == "position":
        return f"a {_object_words(objs[0])} {caption.relation} a {_object_words(objs[1])}"
    number = {v: k for k, v in NUMBERS.items()}[len(objs)]
    color = "" if objs[0].color is None else f"{objs[0].color} "
    return f"{number} {color}{PLURALS[objs[0].shape]}"


def _make(form: str, objects: Sequence[ObjectSpec], relation: str | None = None) -> Caption:
    if form == "single":
        task = "single_object" if objects[0].color is None else "colors"
    elif form == "two":
        task = "color_attr" if all(o.color is not None for o in objects) else "two_object"
    else:
        task = form
    return Caption(tuple(objects), relation, task, form)


def _parse_object(words: list[str], prompt: str) -> tuple[ObjectSpec, list[str]]:
    """``[colour] shape`` at the front of ``words``; returns the spec and the rest."""
    color = None
    if words and words[0] in COLORS:
        color, words = words[0], words[1:]
    if not words or words[0] not in SHAPES:
        got = words[0] if words else "the end of the caption"
        raise CaptionError(
            f"caption {prompt!r}: expected a shape ({', '.join(SHAPES)}), got {got!r}"
        )
    return ObjectSpec(words[0], color), words[1:]


def parse_caption(prompt: str) -> Caption:
    """Parse a caption of the grammar (module docstring); `CaptionError` names the caption
    and what was wrong. Case and surrounding/multiple spaces are ignored."""
    if not isinstance(prompt, str):
        raise CaptionError(f"caption {prompt!r}: expected a string, got {type(prompt).__name__}")
    words = prompt.lower().split()
    if not words:
        raise CaptionError(f"caption {prompt!r}: empty")
    if words[0] in NUMBERS:  # counting
        n, rest = NUMBERS[words[0]], words[1:]
        color = None
        if rest and rest[0] in COLORS:
            color, rest = rest[0], rest[1:]
        singular = {v: k for k, v in PLURALS.items()}
        if len(rest) != 1 or rest[0] not in singular:
            raise CaptionError(
                f"caption {prompt!r}: a counting caption is 'NUMBER [COLOUR] PLURAL' with "
                f"PLURAL one of {', '.join(PLURALS.values())}"
            )
        return _make("counting", [ObjectSpec(singular[rest[0]], color)] * n)
    if words[0] != "a":
        raise CaptionError(
            f"caption {prompt!r}: must start with 'a' or a number ({', '.join(NUMBERS)})"
        )
    first, rest = _parse_object(words[1:], prompt)
    if not rest:
        return _make("single", [first])
    joined = " ".join(rest)
    for form, lead in [("two", "and")] + [("position", r) for r in RELATIONS]:
        if joined.startswith(lead + " a "):
            tail = rest[len(lead.split()) + 1 :]
            second, extra = _parse_object(tail, prompt)
            if extra:
                raise CaptionError(f"caption {prompt!r}: unexpected words {' '.join(extra)!r}")
            if second.shape == first.shape:
                raise CaptionError(
                    f"caption {prompt!r}: the two objects must have different shapes"
                )
            return _make(form, [first, second], None if form == "two" else lead)
    raise CaptionError(
        f"caption {prompt!r}: after the first object expected 'and a' or a relation "
        f"({', '.join(RELATIONS)}) followed by 'a', got {joined!r}"
    )


def vocabulary() -> list[str]:
    """Every word the grammar uses (for a word-level tokenizer), in a fixed order."""
    words = ["a", "and", "of", *NUMBERS, *COLORS, *SHAPES, *PLURALS.values()]
    for r in RELATIONS:
        words += [w for w in r.split() if w not in words]
    return list(dict.fromkeys(words))


def _object_specs() -> list[ObjectSpec]:
    return [ObjectSpec(s, c) for c in (None, *COLORS) for s in SHAPES]


def all_captions() -> list[Caption]:
    """Every caption of the grammar (2256), in a fixed order."""
    out = [_make("single", [o]) for o in _object_specs()]
    pairs = [(a, b) for a in _object_specs() for b in _object_specs() if a.shape != b.shape]
    out += [_make("two", [a, b]) for a, b in pairs]
    out += [_make("position", [a, b], r) for r in RELATIONS for a, b in pairs]
    out += [
        _make("counting", [ObjectSpec(s, c)] * n)
        for n in NUMBERS.values()
        for c in (None, *COLORS)
        for s in SHAPES
    ]
    return out


def split_of(caption: Caption | str) -> str:
    """``"heldout"`` when the caption uses a held-out composition (module docstring), else
    ``"train"``."""
    cap = parse_caption(caption) if isinstance(caption, str) else caption
    if any((o.color, o.shape) in HELD_OUT_PAIRS for o in cap.objects):
        return "heldout"
    if cap.form == "counting" and (len(cap.objects), cap.objects[0].shape) in HELD_OUT_COUNTS:
        return "heldout"
    if cap.form == "position":
        triple = (cap.objects[0].shape, cap.relation, cap.objects[1].shape)
        if triple in HELD_OUT_RELATIONS:
            return "heldout"
    return "train"


@cache
def _captions_by_task(split: str) -> dict[str, list[Caption]]:
    by_task: dict[str, list[Caption]] = {}
    for cap in all_captions():
        if split in ("all", split_of(cap)):
            by_task.setdefault(cap.task, []).append(cap)
    return by_task


def sample_caption(
    rng: np.random.Generator,
    split: str = "train",
    task_weights: Mapping[str, float] | None = None,
) -> Caption:
    """A caption of ``split`` ("train", "heldout", or "all": every caption of the grammar):
    a task type (among those the split has) uniformly, or with probability proportional to
    ``task_weights[type]`` (1 for a type it does not name), then a caption of that type
    uniformly."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split: expected 'train', 'heldout' or 'all', got {split!r}")
    by_task = _captions_by_task(split)
    tasks = sorted(by_task)
    if task_weights is None:
        task = tasks[int(rng.integers(len(tasks)))]
    else:
        task = tasks[int(rng.choice(len(tasks), p=_task_probabilities(tasks, task_weights)))]
    caps = by_task[task]
    return caps[int(rng.integers(len(caps)))]


def _task_probabilities(tasks: list[str], task_weights: Mapping[str, float]) -> np.ndarray:
    for name, w in task_weights.items():
        if name not in TASKS:
            raise ValueError(f"task_weights: unknown task type {name!r}; the types are {TASKS}")
        if isinstance(w, bool) or not isinstance(w, (int, float, np.number)):
            raise ValueError(f"task_weights: {name} must be a finite number >= 0, got {w!r}")
        if not (np.isfinite(w) and w >= 0):
            raise ValueError(f"task_weights: {name} must be a finite number >= 0, got {w!r}")
    weights = np.array([float(task_weights.get(t, 1.0)) for t in tasks])
    if weights.sum() <= 0:
        raise ValueError(f"task_weights: the weights of {tasks} are all 0")
    return weights / weights.sum()


def write_splits(out_dir: str | Path, per_task: int = 32, seed: int = 0) -> dict[str, Path]:
    """Write ``train.txt`` and ``heldout.txt`` under ``out_dir``: one caption per line (the
    ``.txt`` prompt format of ``data.file`` / ``data.val_file``), at most ``per_task``
    captions of each task type drawn without replacement with ``seed``, grouped by task type
    in `TASKS` order. Returns {split: path}."""
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "heldout"):
        by_task = _captions_by_task(split)
        lines = []
        for task in TASKS:
            caps = by_task.get(task, [])
            pick = rng.permutation(len(caps))[:per_task]
            lines += [format_caption(caps[i]) for i in sorted(pick)]
        paths[split] = out / f"{split}.txt"
        paths[split].write_text("\n".join(lines) + "\n")
    return paths


# ------------------------------------------------------------------ renderer
def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, x: int, y: int, s: int, rgb) -> None:
    """Draw ``shape`` filling the box (x, y, x + s - 1, y + s - 1), no anti-aliasing."""
    x1, y1 = x + s - 1, y + s - 1
    if shape == "square":
        draw.rectangle((x, y, x1, y1), fill=rgb)
    elif shape == "circle":
        draw.ellipse((x, y, x1, y1), fill=rgb)
    elif shape == "triangle":  # apex up, base along the bottom
        draw.polygon([((x + x1) / 2, y), (x1, y1), (x, y1)], fill=rgb)
    elif shape == "cross":  # a plus sign, arms a third of the size wide
        arm = max(1, round(s / 3))
        lo = x + (s - arm) // 2
        draw.rectangle((lo, y, lo + arm - 1, y1), fill=rgb)
        lo = y + (s - arm) // 2
        draw.rectangle((x, lo, x1, lo + arm - 1), fill=rgb)
    else:  # pragma: no cover - parse_caption admits only SHAPES
        raise ValueError(f"shape: unknown shape {shape!r}")


def _relation_holds(relation: str, a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether centroid ``a`` is ``relation`` centroid ``b`` (x right, y down): the offset
    along the relation's axis has the right sign and is larger than the other offset."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    if relation == "left of":
        return dx > abs(dy)
    if relation == "right of":
        return -dx > abs(dy)
    if relation == "above":
        return dy > abs(dx)
    if relation == "below":
        return -dy > abs(dx)
    raise ValueError(f"relation: unknown relation {relation!r}")  # pragma: no cover


# Object boxes' sides as fractions of the image side: one or two objects get (0.3, 0.45), 10-14
# pixels at 32 (at 8 a circle and a square differ in a few pixels, which the toy model's samples
# and its VAE blur away); three or four get (0.25, 0.32), or random placement rarely fits them.
BOX_SIDE = (0.3, 0.45)
BOX_SIDE_CROWDED = (0.25, 0.32)


def render(caption: Caption | str, seed: int, size: int = 32) -> Image.Image:
    """A ``size`` x ``size`` RGB image that satisfies ``caption``, the same for the same
    (caption, seed, size).

    Each object is a flat palette colour (a random one when the caption gives none) in a
    square box of side ``BOX_SIDE`` x ``size`` (``BOX_SIDE_CROWDED`` for three or more
    objects); boxes keep 2 pixels apart and 1 from the border, and a position caption's
    centres are placed so the relation holds with a margin (``|along| >= |across| + s/2``).
    """
    cap = parse_caption(caption) if isinstance(caption, str) else caption
    if int(size) < 16:
        raise ValueError(f"size: at least 16 pixels, got {size}")
    size = int(size)
    rng = np.random.default_rng(seed)
    n = len(cap.objects)
    side_lo, side_hi = BOX_SIDE_CROWDED if n >= 3 else BOX_SIDE
    lo = max(5, round(side_lo * size))
    hi = max(lo, round(side_hi * size))
    for _ in range(2000):
        sides = [int(rng.integers(lo, hi + 1)) for _ in range(n)]
        boxes = []
        for s in sides:
            x = int(rng.integers(1, size - s))
            y = int(rng.integers(1, size - s))
            boxes.append((x, y, s))
        if not _boxes_apart(boxes, gap=2):
            continue
        if cap.relation is not None:
            (xa, ya, sa), (xb, yb, sb) = boxes
            a, b = (xa + sa / 2, ya + sa / 2), (xb + sb / 2, yb + sb / 2)
            along = _relation_margin(cap.relation, a, b)
            if along < min(sa, sb) / 2:
                continue
        break
    else:  # pragma: no cover - 2000 draws always find a placement at size >= 16
        raise RuntimeError(f"render: no placement for {format_caption(cap)!r} at size {size}")
    colors = [o.color or list(COLORS)[int(rng.integers(len(COLORS)))] for o in cap.objects]
    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for obj, color, (x, y, s) in zip(cap.objects, colors, boxes):
        _draw_shape(draw, obj.shape, x, y, s, COLORS[color])
    return img


def _boxes_apart(boxes: list[tuple[int, int, int]], gap: int) -> bool:
    for (x1, y1, s1), (x2, y2, s2) in itertools.combinations(boxes, 2):
        if x1 < x2 + s2 + gap and x2 < x1 + s1 + gap and y1 < y2 + s2 + gap and y2 < y1 + s1 + gap:
            return False
    return True


def _relation_margin(relation: str, a: tuple[float, float], b: tuple[float, float]) -> float:
    """Offset along the relation's axis minus the offset across it (> 0: relation holds)."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    along, across = {
        "left of": (dx, dy),
        "right of": (-dx, dy),
        "above": (dy, dx),
        "below": (-dy, dx),
    }[relation]
    return along - abs(across)


# ------------------------------------------------------------------ detector
@dataclass(frozen=True)
class DetectedObject:
    """A connected region of one palette colour: its colour, shape (None: no shape matched),
    centroid (x, y) in pixels and area in pixels."""

    color: str
    shape: str | None
    centroid: tuple[float, float]
    area: int


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean mask, each as an (N, 2) array of (row, col)."""
    h, w = mask.shape
    seen = np.zeros_like(mask, dtype=bool)
    comps = []
    for r0, c0 in zip(*np.nonzero(mask)):
        if seen[r0, c0]:
            continue
        seen[r0, c0] = True
        stack, pix = [(int(r0), int(c0))], []
        while stack:
            r, c = stack.pop()
            pix.append((r, c))
            for rr, cc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
                if 0 <= rr < h and 0 <= cc < w and mask[rr, cc] and not seen[rr, cc]:
                    seen[rr, cc] = True
                    stack.append((rr, cc))
        comps.append(np.array(pix))
    return comps


@cache
def _shape_template(shape: str, side: int) -> tuple[np.ndarray, np.ndarray]:
    """The pixels ((N, 2) rows, cols) that `_draw_shape` fills for ``shape`` in a box of
    ``side``, and their centroid."""
    img = Image.new("L", (side, side), 0)
    _draw_shape(ImageDraw.Draw(img), shape, 0, 0, side, 255)
    pix = np.argwhere(np.asarray(img) > 0)
    return pix, pix.mean(axis=0)


def shape_iou(pix: np.ndarray, shape: str) -> float:
    """How well a component (pixels as (N, 2) rows, cols) matches ``shape``: the best
    intersection over union with the shape as `_draw_shape` draws it, over box sides within
    2 pixels of the one whose area matches and over placements within 1 pixel of the
    component's centroid. A ragged outline costs the few pixels it changes, so the verdict
    survives it (a detector such as GenEval's is tolerant the same way); two different shapes
    of equal area overlap at most ~0.83 (a circle and a square)."""
    area = len(pix)
    centroid = pix.mean(axis=0)
    origin = pix.min(axis=0) - 24  # the canvas holds every tried placement
    canvas = np.zeros(tuple(pix.max(axis=0) - origin + 25), dtype=bool)
    canvas[pix[:, 0] - origin[0], pix[:, 1] - origin[1]] = True
    fill = len(_shape_template(shape, 12)[0]) / 144
    side0 = int(np.sqrt(area / fill))
    best = 0.0
    for side in range(max(3, side0 - 2), side0 + 3):
        tpix, tcentroid = _shape_template(shape, side)
        base = np.round(centroid - origin - tcentroid).astype(int)
        for dr, dc in itertools.product((-1, 0, 1), repeat=2):
            rows = tpix[:, 0] + base[0] + dr
            cols = tpix[:, 1] + base[1] + dc
            inter = int(canvas[rows, cols].sum())
            best = max(best, inter / (area + len(tpix) - inter))
    return best


def _classify(pix: np.ndarray, min_iou: float) -> str | None:
    ious = {shape: shape_iou(pix, shape) for shape in SHAPES}
    best = max(ious, key=ious.__getitem__)
    return best if ious[best] >= min_iou else None


def detect_objects(
    image: np.ndarray,
    *,
    tolerance: float = 60.0,
    min_area: float = 0.012,
    min_shape_iou: float = 0.5,
) -> list[DetectedObject]:
    """The objects in a uint8 (H, W, 3) image.

    Each pixel takes the nearest colour of `COLORS` plus `BACKGROUND` if it lies within
    ``tolerance`` (Euclidean RGB distance), else none. Each 4-connected region of one
    palette colour with at least ``min_area * H * W`` pixels is an object (smaller specks
    are ignored); its shape is the one of `SHAPES` it overlaps best (`shape_iou`), or None when
    that best intersection over union is below ``min_shape_iou``.
    """
    img = np.asarray(image, dtype=np.float64)[..., :3]
    names = [*COLORS, "background"]
    table = np.array([*COLORS.values(), BACKGROUND], dtype=np.float64)
    dist = np.linalg.norm(img[:, :, None, :] - table[None, None], axis=-1)
    nearest = dist.argmin(axis=-1)
    valid = dist.min(axis=-1) <= tolerance
    floor = max(1, int(np.ceil(min_area * img.shape[0] * img.shape[1])))
    objects = []
    for k, name in enumerate(names[:-1]):
        for pix in _components(valid & (nearest == k)):
            if len(pix) < floor:
                continue
            cy, cx = pix.mean(axis=0)
            shape = _classify(pix, min_shape_iou)
            objects.append(DetectedObject(name, shape, (float(cx), float(cy)), len(pix)))
    return objects


def check_image(caption: Caption | str, objects: Sequence[DetectedObject]) -> dict[str, float]:
    """GenEval-style verdict of detected objects against a caption: a dict of 0/1 parts
    ``count`` (as many objects as named), ``object`` (the named shapes, as a multiset),
    ``colour`` (each named shape in its named colour; NaN when the caption names no colour),
    ``position`` (the relation between the two objects' centroids; NaN unless a position
    caption) and ``correct`` (all applicable parts)."""
    cap = parse_caption(caption) if isinstance(caption, str) else caption
    want_shapes = Counter(o.shape for o in cap.objects)
    got_shapes = Counter(o.shape for o in objects)
    count = float(len(objects) == len(cap.objects))
    obj = float(got_shapes == want_shapes)
    colour = float("nan")
    if any(o.color is not None for o in cap.objects):
        ok = obj == 1.0
        for spec in set(cap.objects):
            if spec.color is not None:
                ok = ok and all(d.color == spec.color for d in objects if d.shape == spec.shape)
        colour = float(ok)
    position = float("nan")
    if cap.relation is not None:
        position = 0.0
        if obj == 1.0 and count == 1.0:
            a = next(d for d in objects if d.shape == cap.objects[0].shape)
            b = next(d for d in objects if d.shape == cap.objects[1].shape)
            position = float(_relation_holds(cap.relation, a.centroid, b.centroid))
    parts = [count, obj, colour, position]
    correct = float(all(p == 1.0 for p in parts if not np.isnan(p)))
    return {"count": count, "object": obj, "colour": colour, "position": position,
            "correct": correct}  # fmt: skip


# ------------------------------------------------------------------ reward
@register_prompt_check("shapes")
def _caption_in_grammar(prompt: str, options: dict) -> str | None:
    try:
        parse_caption(prompt)
    except CaptionError as e:
        return str(e)
    return None


class ShapesReward(Reward):
    """score = 1 if the image shows exactly the caption's objects (shapes, count, colours,
    position), else 0 (`check_image` on `detect_objects`). Inputs: ``images`` and
    ``prompts`` in the grammar of this module; a prompt outside it raises `CaptionError`
    naming the prompt and its index.

    ``partial_credit=True`` scores the mean of the caption's parts instead (count, object,
    and colour and position where the caption has them; each part needs the ones before it,
    see `check_image`): a denser signal for RL from a weak model; the strict verdict stays in
    the details.

    ``details``: ``correct`` (the strict 0/1 verdict), ``count``, ``object``, ``colour``,
    ``position`` (0/1 per part, NaN where the caption has no such part), ``n_objects``
    (objects detected), and ``task_<type>`` for each of `TASKS` (the strict verdict for
    prompts of that type, NaN for the others, so a mean over the batch that ignores NaN is
    the per-task accuracy).
    """

    name = "shapes"

    def __init__(
        self,
        *,
        tolerance: float = 60.0,
        min_area: float = 0.012,
        min_shape_iou: float = 0.5,
        partial_credit: bool = False,
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, workers=workers)
        for key, v in (("tolerance", tolerance), ("min_area", min_area),
                       ("min_shape_iou", min_shape_iou)):  # fmt: skip
            if not float(v) > 0:
                raise ValueError(f"{key}: must be > 0, got {v}")
        if float(min_shape_iou) > 1:  # an intersection over union is at most 1: nothing would match
            raise ValueError(f"min_shape_iou: must be <= 1, got {min_shape_iou}")
        self.tolerance = float(tolerance)
        self.min_area = float(min_area)
        self.min_shape_iou = float(min_shape_iou)
        self.partial_credit = bool(partial_credit)

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        images = inp.image_list(self.name)
        prompts = inp.prompt_list(self.name)
        caps = []
        for i, p in enumerate(prompts):
            try:
                caps.append(parse_caption(p))
            except CaptionError as e:
                raise CaptionError(f"{self.name}: prompts[{i}]: {e}") from None
        rows = []
        for img, cap in zip(images, caps):
            objects = detect_objects(
                img,
                tolerance=self.tolerance,
                min_area=self.min_area,
                min_shape_iou=self.min_shape_iou,
            )
            rows.append((check_image(cap, objects), len(objects)))
        details = {
            k: np.array([r[k] for r, _ in rows], dtype=np.float32)
            for k in ("correct", *VERDICT_PARTS)
        }
        if self.partial_credit:
            parts = np.stack([details[k] for k in VERDICT_PARTS])
            scores = np.nanmean(parts, axis=0).astype(np.float32)
        else:
            scores = details["correct"].copy()
        details["n_objects"] = np.array([n for _, n in rows], dtype=np.float32)
        for task in TASKS:  # GenEval's strict verdict, whatever the score
            details[f"task_{task}"] = np.array(
                [s if c.task == task else np.nan for s, c in zip(details["correct"], caps)],
                dtype=np.float32,
            )
        return RewardOutput(scores, details)


def task_types(prompts: Iterable[str]) -> list[str]:
    """The task type (`TASKS`) of each prompt."""
    return [parse_caption(p).task for p in prompts]
