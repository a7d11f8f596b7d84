"""`omni-train prepare NAME`: write datasets (JSONL, + PNG folders) the recipes read from `data.file`.

The prompt lists are generated from small word lists shipped here, deterministically
(`seed`), and split into `train.jsonl` / `test.jsonl` (one `{"prompt": ...}` object per line;
OCR rows also carry the target text as `"reference"`).

- `ocr`: text-rendering prompts that quote the text to draw (the OCR reward reads the target
  between the double quotes), Flow-GRPO's OCR task format;
- `pickscore`: subject x setting x style prompts, PickScore / preference style;
- `video`: short motion descriptions for text-to-video.

Image datasets (rendered here with PIL; item i is a pure function of (seed, i); `size` is the
image side in pixels, `count` the number of items):

- `edit`: image-editing pairs for Qwen-Image-Edit: a flat scene (a coloured background and one
  to three shapes of distinct kinds, each in its own cell of a 2 x 2 grid) and an instruction
  that names what to change: "make the background red", "turn the square blue", "add a green
  circle", "make the background brighter". Rows ``{"prompt", "image", "target", "edit"}``:
  ``image`` the source PNG (``images/``), ``target`` the scene rendered with the edit applied
  (``targets/``, for evaluation), ``edit`` the kind. Colour words are `omni_rewards`'
  `PALETTE` names, so the `color_match` reward reads the requested colour from the prompt.
  `train.jsonl` / `test.jsonl`.
- `mmk12`: the generated `shapes` counting task (omni_train.tasks) in the MMK12 file format:
  rows ``{"prompt", "answer", "image"}`` with PNGs under ``images/``; `train.jsonl` (`count`
  items) and `val.jsonl` (count // 8, at least 4, from the task's held-out split). A stand-in
  with the real format, not the MMK12 release.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .seeds import derive_seed

WORDS = (
    "OPEN",
    "CLOSED",
    "HELLO",
    "CAFE",
    "EXIT",
    "SALE",
    "PIZZA",
    "BOOKS",
    "HOTEL",
    "MUSIC",
    "BAKERY",
    "GARDEN",
    "SCHOOL",
    "TAXI",
    "STOP",
    "WELCOME",
    "LIBRARY",
    "MARKET",
    "FRESH",
    "SUMMER",
    "WINTER",
    "COFFEE",
    "DANGER",
    "PHARMACY",
    "CINEMA",
    "STATION",
    "HARBOR",
    "THEATER",
    "MUSEUM",
    "PARKING",
    "TICKETS",
    "BAR",
    "DINER",
    "FLOWERS",
    "BEACH",
    "ROBOTS",
)
OCR_TEMPLATES = (
    'a shop sign that says "{w}"',
    'a neon sign reading "{w}"',
    'a chalkboard with the word "{w}" written on it',
    'a poster with the title "{w}" in bold letters',
    'a t-shirt printed with "{w}"',
    'a wooden sign carved with "{w}"',
)
SUBJECTS = (
    "a red fox",
    "an old lighthouse",
    "a bowl of ramen",
    "a vintage car",
    "a snow leopard",
    "a cozy reading nook",
    "a hot air balloon",
    "a koi pond",
    "a steam locomotive",
    "a corgi",
    "a glass teapot",
    "a castle on a hill",
    "an astronaut",
    "a sailboat",
)
SETTINGS = (
    "at sunset",
    "in the rain",
    "under the northern lights",
    "in a misty forest",
    "on a busy street",
    "in a sunlit kitchen",
    "on the moon",
    "in autumn",
)
STYLES = (
    "photorealistic",
    "watercolor painting",
    "studio lighting, 35mm photo",
    "oil painting",
    "isometric 3d render",
    "pencil sketch",
    "ukiyo-e woodblock print",
    "cinematic, 8k",
)
MOTIONS = (
    "a dancer spinning on a stage",
    "waves rolling onto a beach",
    "a cat chasing a ball",
    "leaves falling in the wind",
    "a car driving along a coastal road",
    "a candle flickering",
    "a flag waving on a pole",
    "a chef tossing vegetables in a pan",
    "clouds drifting over hills",
    "a dog running through a field",
    "fireworks over a city",
    "a river flowing through a canyon",
)


def _ocr() -> list[dict]:
    return [
        {"prompt": t.format(w=w), "reference": w}
        for w, t in itertools.product(WORDS, OCR_TEMPLATES)
    ]


def _pickscore() -> list[dict]:
    return [
        {"prompt": f"{s} {where}, {style}"}
        for s, where, style in itertools.product(SUBJECTS, SETTINGS, STYLES)
    ]


def _video() -> list[dict]:
    return [{"prompt": f"{m}, {style}"} for m, style in itertools.product(MOTIONS, STYLES[:4])]


DATASETS: dict[str, Callable[[], list[dict]]] = {
    "ocr": _ocr,
    "pickscore": _pickscore,
    "video": _video,
}

# ------------------------------------------------------------------ image datasets
EDIT_SHAPES = ("square", "circle", "triangle")
EDIT_KINDS = ("background", "recolor", "add", "brighter")
_DOMAIN_EDIT = 21  # seed domain of the edit scenes (apart from the trainer's and tasks')


def _palette() -> dict[str, tuple[int, int, int]]:
    from omni_rewards.image import PALETTE

    return dict(PALETTE)


def render_scene(scene: dict[str, Any], size: int) -> np.ndarray:
    """uint8 (size, size, 3) image of a scene ``{"background": rgb, "shapes": [{"kind",
    "color": rgb, "cell": 0..3, "box": [x0, y0, x1, y1] in cell fractions}]}``."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), tuple(scene["background"]))
    draw = ImageDraw.Draw(img)
    half = size / 2
    for sh in scene["shapes"]:
        r, q = divmod(sh["cell"], 2)
        fx0, fy0, fx1, fy1 = sh["box"]
        box = [
            round(q * half + fx0 * half),
            round(r * half + fy0 * half),
            round(q * half + fx1 * half) - 1,
            round(r * half + fy1 * half) - 1,
        ]
        color = tuple(sh["color"])
        if sh["kind"] == "square":
            draw.rectangle(box, fill=color)
        elif sh["kind"] == "circle":
            draw.ellipse(box, fill=color)
        else:
            x0, y0, x1, y1 = box
            draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=color)
    return np.asarray(img, dtype=np.uint8).copy()


def edit_item(index: int, seed: int = 0) -> tuple[dict, dict, str, str]:
    """Item `index` of the `edit` set: (source scene, edited scene, instruction, edit kind);
    a pure function of (seed, index)."""
    palette = _palette()
    names = sorted(palette)
    rng = np.random.default_rng(derive_seed(seed, 0, index, _DOMAIN_EDIT))

    def pick(avoid: set[str]) -> str:
        return str(rng.choice([c for c in names if c not in avoid]))

    bg = pick(set())
    n = int(rng.integers(1, 4))
    kinds = [str(k) for k in rng.permutation(EDIT_SHAPES)[:n]]
    cells = [int(c) for c in rng.permutation(4)[:n]]
    shapes = []
    for kind, cell in zip(kinds, cells):
        side = float(rng.uniform(0.45, 0.7))
        x0, y0 = (float(v) for v in rng.uniform(0.1, 0.9 - side, 2))
        shapes.append(
            {"kind": kind, "name": pick({bg}), "cell": cell, "box": [x0, y0, x0 + side, y0 + side]}
        )
    used = {bg} | {s["name"] for s in shapes}
    choices = ["background", "recolor", "brighter"]
    if n < 3:
        choices.append("add")
    if bg == "white":
        choices.remove("brighter")
    edit = str(rng.choice(choices))
    new_bg, new_shapes = palette[bg], [dict(s) for s in shapes]
    if edit == "background":
        c = pick(used)
        new_bg = palette[c]
        prompt = str(rng.choice(["make the background {c}", "change the background to {c}"]))
        prompt = prompt.format(c=c)
    elif edit == "recolor":
        j = int(rng.integers(0, n))
        c = pick({bg, shapes[j]["name"]})
        new_shapes[j]["name"] = c
        verb = str(rng.choice(["turn", "make", "paint"]))
        prompt = f"{verb} the {shapes[j]['kind']} {c}"
    elif edit == "add":
        kind = next(k for k in EDIT_SHAPES if k not in kinds)
        cell = next(int(c) for c in rng.permutation(4) if int(c) not in cells)
        side = float(rng.uniform(0.45, 0.7))
        x0, y0 = (float(v) for v in rng.uniform(0.1, 0.9 - side, 2))
        c = pick({bg})
        new_shapes.append(
            {"kind": kind, "name": c, "cell": cell, "box": [x0, y0, x0 + side, y0 + side]}
        )
        prompt = f"add a {c} {kind}"
    else:  # brighter: the background halfway to white
        new_bg = tuple(round((v + 255) / 2) for v in palette[bg])
        prompt = "make the background brighter"

    def scene(background, items) -> dict:
        return {
            "background": list(background),
            "shapes": [{**s, "color": list(palette[s["name"]])} for s in items],
        }

    return scene(palette[bg], shapes), scene(new_bg, new_shapes), prompt, edit


def _save_png(image: np.ndarray, path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path, format="PNG")


def _edit(root: Path, *, seed: int, size: int | None, count: int | None, test_fraction: float):
    size, count = size or 512, count or 512
    if size < 16:
        raise ValueError(f"prepare edit: --size must be at least 16 pixels, got {size}")
    if count < 2:
        raise ValueError(f"prepare edit: --count must be at least 2, got {count}")
    rows = []
    for i in range(count):
        src, dst, prompt, kind = edit_item(i, seed)
        image, target = f"images/{i:05d}.png", f"targets/{i:05d}.png"
        _save_png(render_scene(src, size), root / image)
        _save_png(render_scene(dst, size), root / target)
        rows.append({"prompt": prompt, "image": image, "target": target, "edit": kind})
    n_test = max(1, int(count * test_fraction))
    return {"test": rows[:n_test], "train": rows[n_test:]}


def _mmk12(root: Path, *, seed: int, size: int | None, count: int | None, test_fraction: float):
    from .tasks import shapes_task

    size, count = size or 32, count or 256
    splits = {}
    for split, file_split, n in (("train", "train", count), ("val", "val", max(4, count // 8))):
        rows = []
        for i, item in enumerate(shapes_task(split, n, seed, image_size=size)):
            image = f"images/{split}_{i:05d}.png"
            _save_png(item.image, root / image)  # type: ignore[arg-type]
            rows.append({"prompt": item.prompt, "answer": item.answer, "image": image})
        splits[file_split] = rows
    return splits


#: image datasets: name -> fn(root, *, seed, size, count, test_fraction) -> {split: rows}
IMAGE_DATASETS: dict[str, Callable[..., dict[str, list[dict]]]] = {
    "edit": _edit,
    "mmk12": _mmk12,
}


def prepare(
    name: str,
    out: str | Path | None = None,
    *,
    test_fraction: float = 0.1,
    seed: int = 0,
    size: int | None = None,
    count: int | None = None,
) -> dict[str, Path]:
    """Write `<out>/<split>.jsonl` for dataset `name` (default out: `data/<name>`), with the
    images of an image dataset beside them; returns the paths by split.

    ``size`` (image side) and ``count`` (items) apply to the image datasets only.
    """
    known = sorted([*DATASETS, *IMAGE_DATASETS])
    if name not in known:
        raise ValueError(f"prepare: unknown dataset {name!r}; known: {', '.join(known)}")
    root = Path(out) if out is not None else Path("data") / name
    root.mkdir(parents=True, exist_ok=True)
    if name in IMAGE_DATASETS:
        splits = IMAGE_DATASETS[name](
            root, seed=seed, size=size, count=count, test_fraction=test_fraction
        )
    else:
        if size is not None or count is not None:
            raise ValueError(f"prepare: --size / --count apply to image datasets, not {name!r}")
        rows = DATASETS[name]()
        random.Random(seed).shuffle(rows)
        n_test = max(1, int(len(rows) * test_fraction))
        splits = {"test": rows[:n_test], "train": rows[n_test:]}
    paths = {}
    for split, items in splits.items():
        p = root / f"{split}.jsonl"
        tmp = p.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in items))
        tmp.replace(p)
        paths[split] = p
    return paths
