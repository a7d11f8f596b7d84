"""`omni-train prepare NAME`: write prompt datasets (JSONL) the recipes read from `data.file`.

The prompt lists are generated from small word lists shipped here, deterministically
(`seed`), and split into `train.jsonl` / `test.jsonl` (one `{"prompt": ...}` object per line;
OCR rows also carry the target text as `"reference"`).

- `ocr`: text-rendering prompts that quote the text to draw (the OCR reward reads the target
  between the double quotes), Flow-GRPO's OCR task format;
- `pickscore`: subject x setting x style prompts, PickScore / preference style;
- `video`: short motion descriptions for text-to-video.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path

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


def prepare(
    name: str, out: str | Path | None = None, *, test_fraction: float = 0.1, seed: int = 0
) -> dict[str, Path]:
    """Write `<out>/train.jsonl` and `<out>/test.jsonl` for dataset `name` (default out:
    `data/<name>`); returns the paths."""
    if name not in DATASETS:
        raise ValueError(f"prepare: unknown dataset {name!r}; known: {', '.join(sorted(DATASETS))}")
    rows = DATASETS[name]()
    random.Random(seed).shuffle(rows)
    n_test = max(1, int(len(rows) * test_fraction))
    splits = {"test": rows[:n_test], "train": rows[n_test:]}
    root = Path(out) if out is not None else Path("data") / name
    root.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, items in splits.items():
        p = root / f"{split}.jsonl"
        tmp = p.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in items))
        tmp.replace(p)
        paths[split] = p
    return paths
