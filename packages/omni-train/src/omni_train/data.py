"""Prompt datasets (with optional condition images) and the per-step prompt order.

The prompts of step `s` are a pure function of (run seed, s): the stream of prompt slots
k = s * P + i (P prompts per step) walks epoch e = k // N through a permutation of the N
rows seeded by (seed, e). Resuming at step s therefore needs no saved data-loader state.

`data.file` formats (bad rows are reported by line number, or Parquet row number from 0):

- ``.txt``: one prompt per non-empty line;
- ``.jsonl`` (any other suffix): one object per line with a string ``prompt`` and optionally
  ``image``, a PNG/JPEG path relative to the file's folder (or absolute): the source image of
  an image-editing model (Qwen-Image-Edit). Other keys are ignored;
- ``.parquet``: columns ``prompt`` (string) and optionally ``image``: a path string (relative
  to the file's folder), PNG/JPEG bytes, or a ``{bytes, path}`` struct (the Hugging Face
  `datasets` Image feature). Needs pyarrow (``pip install 'omni-train[parquet]'``).

Images are checked (opened, header read) when the file is read and decoded to uint8 RGB
``(H, W, 3)`` when a step uses them.

Every problem is one `RecipeError` naming the file and the line (or row): a file that is not
UTF-8 (the byte and column; a UTF-16 file is named as such), a string that is not valid
Unicode (a lone surrogate escaped in JSON), a prompt longer than `MAX_PROMPT_CHARS`
characters (text encoders keep a few hundred tokens; tokenising a megabyte first takes
minutes), a path that is a directory or not a regular file.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .recipe import DataConfig, RecipeError
from .seeds import DOMAIN_DATA, derive_seed

__all__ = [
    "MAX_PROMPT_CHARS",
    "DataRow",
    "ImageRef",
    "JsonlRow",
    "PromptData",
    "check_prompt",
    "data_file",
    "read_data_file",
    "read_jsonl_rows",
    "read_prompt_file",
    "read_text_lines",
]

PARQUET_HINT = "pip install 'omni-train[parquet]' (or: pip install pyarrow)"

#: the longest prompt accepted, in characters (the longest text encoder input here is 512
#: tokens; a token is rarely more than a dozen characters)
MAX_PROMPT_CHARS = 16_384


def data_file(path: str | Path, key: str, what: str = "") -> Path:
    """``path`` as a readable regular file; RecipeError naming ``key`` otherwise (missing, a
    directory, a FIFO or device, unreadable). ``what`` prefixes the path in the message."""
    p = Path(path).expanduser()
    label = f"{what} {p}" if what else str(p)
    try:
        if not p.exists():
            raise RecipeError(f"{key}: {label} does not exist")
        if p.is_dir():
            raise RecipeError(f"{key}: {label} is a directory, not a file")
        if not p.is_file():
            raise RecipeError(f"{key}: {label} is not a regular file")
    except OSError as exc:  # e.g. a path too long, or a folder we may not list
        raise RecipeError(f"{key}: {label}: {exc.strerror or exc}") from None
    return p


def read_text_lines(p: Path, key: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file (a UTF-8 BOM is allowed, line ends
    ``\\n`` or ``\\r\\n``); RecipeError naming the file and line for bytes that are not UTF-8."""
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise RecipeError(f"{key} {p}: cannot read ({exc.strerror or exc})") from None
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise RecipeError(
            f"{key} {p}: the file is UTF-16 (it starts with a UTF-16 BOM); save it as UTF-8"
        )
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        offset = exc.start - (data.rfind(b"\n", 0, exc.start) + 1)
        raise RecipeError(
            f"{key} {p}, line {line}: not UTF-8 (byte 0x{data[exc.start]:02x} at byte "
            f"{offset} of the line); save the file as UTF-8"
        ) from None
    return [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), start=1)]


def check_prompt(prompt: str, where: str, field_name: str = "prompt") -> str:
    """``prompt`` if it is valid Unicode, has no NUL and is at most `MAX_PROMPT_CHARS` long;
    RecipeError naming ``where`` otherwise."""
    if len(prompt) > MAX_PROMPT_CHARS:
        raise RecipeError(
            f"{where}: '{field_name}' has {len(prompt)} characters, more than the "
            f"{MAX_PROMPT_CHARS} allowed (text encoders keep a few hundred tokens)"
        )
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RecipeError(
            f"{where}: '{field_name}' is not valid Unicode ({exc.reason} at character "
            f"{exc.start}: {prompt[exc.start]!r})"
        ) from None
    if "\x00" in prompt:
        raise RecipeError(f"{where}: '{field_name}' holds a NUL character")
    return prompt


@dataclass(frozen=True)
class ImageRef:
    """Where one row's image is: a file ``path`` or encoded ``data`` (PNG/JPEG bytes).

    ``where`` names the row in errors ("data.file d.jsonl, line 3").
    """

    where: str
    path: Path | None = None
    data: bytes | None = field(default=None, repr=False)

    def _open(self):
        from PIL import Image

        return Image.open(self.path if self.path is not None else io.BytesIO(self.data or b""))

    def check(self) -> None:
        """Open the image and read its header; RecipeError naming the row when that fails."""
        from PIL import Image

        try:
            with self._open() as im:
                im.size  # noqa: B018 - the header is read on open
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            what = f"image {self.path}" if self.path is not None else "image bytes"
            raise RecipeError(f"{self.where}: {what}: {exc}") from None

    def load(self) -> np.ndarray:
        """The image as uint8 RGB ``(H, W, 3)``."""
        from PIL import Image

        try:
            with self._open() as im:
                return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            what = f"image {self.path}" if self.path is not None else "image bytes"
            raise RecipeError(f"{self.where}: {what}: {exc}") from None


@dataclass(frozen=True)
class DataRow:
    """One row of a data file: its prompt and optional image."""

    prompt: str
    image: ImageRef | None = None


def _image_path(value: str, base: Path, where: str) -> ImageRef:
    ip = Path(value).expanduser()
    ip = data_file(ip if ip.is_absolute() else base / ip, where, "image")
    ref = ImageRef(where, path=ip)
    ref.check()
    return ref


@dataclass(frozen=True)
class JsonlRow:
    """One non-blank line of a JSONL data file, checked: a JSON object with a valid string
    ``prompt``, and its ``image`` (a path relative to the file) opened when it has one."""

    where: str  # names the file and line in errors ("data.file d.jsonl, line 3")
    fields: dict[str, Any]
    image: ImageRef | None

    @property
    def prompt(self) -> str:
        return self.fields["prompt"]


def read_jsonl_rows(p: Path, key: str) -> list[JsonlRow]:
    """The rows of the JSONL file ``p`` (a data file of ``key``); RecipeError naming the line
    for a row that is not JSON, has no valid string ``prompt`` or a bad ``image``."""
    rows = []
    for lineno, line in read_text_lines(p, key):
        if not line.strip():
            continue
        where = f"{key} {p}, line {lineno}"
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError, ValueError) as exc:
            raise RecipeError(f"{where}: not valid JSON ({type(exc).__name__}: {exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise RecipeError(f"{where}: needs a string 'prompt' field")
        check_prompt(row["prompt"], where)
        image = row.get("image")
        if image is not None and (not isinstance(image, str) or not image.strip()):
            raise RecipeError(
                f"{where}: 'image' must be a PNG/JPEG path (relative to the file), got "
                f"{image!r:.80}"
            )
        ref = None if image is None else _image_path(image, p.parent, where)
        rows.append(JsonlRow(where, row, ref))
    return rows


def _read_parquet(p: Path, key: str) -> list[DataRow]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RecipeError(f"{key} {p}: reading Parquet needs pyarrow: {PARQUET_HINT}") from None
    try:
        table = pq.read_table(p)
    except Exception as exc:  # pyarrow raises its own error types
        raise RecipeError(f"{key} {p}: not a readable Parquet file ({exc})") from None
    names = table.column_names
    if "prompt" not in names:
        raise RecipeError(f"{key} {p}: needs a 'prompt' column (columns: {names})")
    prompts = table.column("prompt").to_pylist()
    images = table.column("image").to_pylist() if "image" in names else [None] * len(prompts)
    rows = []
    for i, (prompt, image) in enumerate(zip(prompts, images)):
        where = f"{key} {p}, row {i} (0-based)"
        if not isinstance(prompt, str):
            raise RecipeError(f"{where}: 'prompt' must be a string, got {prompt!r:.80}")
        check_prompt(prompt, where)
        if isinstance(image, dict):  # the datasets Image feature: {"bytes", "path"}
            image = image.get("bytes") or image.get("path")
        if image is None:
            ref = None
        elif isinstance(image, str) and image.strip():
            ref = _image_path(image, p.parent, where)
        elif isinstance(image, bytes) and image:
            ref = ImageRef(where, data=image)
            ref.check()
        else:
            raise RecipeError(
                f"{where}: 'image' must be a path string or PNG/JPEG bytes, got "
                f"{type(image).__name__}"
            )
        rows.append(DataRow(prompt, ref))
    return rows


def read_data_file(path: str | Path, key: str = "data.file") -> list[DataRow]:
    """Rows (prompt, optional image) of a .txt, .jsonl or .parquet file; errors name `key`
    and the line / row."""
    p = data_file(path, key)
    if p.suffix == ".txt":
        rows = [
            DataRow(check_prompt(line.strip(), f"{key} {p}, line {n}"))
            for n, line in read_text_lines(p, key)
            if line.strip()
        ]
    elif p.suffix == ".parquet":
        rows = _read_parquet(p, key)
    else:
        rows = [DataRow(r.prompt, r.image) for r in read_jsonl_rows(p, key)]
    if not rows:
        raise RecipeError(f"{key} {p}: no prompts")
    return rows


def read_prompt_file(path: str | Path) -> list[str]:
    """The prompts of a data file (see :func:`read_data_file`)."""
    return [r.prompt for r in read_data_file(path)]


@dataclass
class PromptData:
    """The training rows and their per-step order.

    ``prompts`` are the rows' prompts (the omni path keeps `OmniItem` objects here);
    ``images`` the rows' image references (None: the source has no images at all), and
    ``source`` names the source in errors.
    """

    prompts: list[Any]
    per_step: int
    seed: int
    shuffle: bool = True
    images: list[ImageRef | None] | None = None
    source: str = "data.prompts"
    _orders: dict[int, list[int]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: DataConfig, seed: int) -> PromptData:
        if cfg.prompts is not None:
            for i, prompt in enumerate(cfg.prompts):
                if isinstance(prompt, str):
                    check_prompt(prompt, f"data.prompts[{i}]")
            return cls(list(cfg.prompts), cfg.prompts_per_step, seed, cfg.shuffle)
        rows = read_data_file(cfg.file)  # type: ignore[arg-type]
        images = [r.image for r in rows]
        return cls(
            [r.prompt for r in rows],
            cfg.prompts_per_step,
            seed,
            cfg.shuffle,
            images if any(im is not None for im in images) else None,
            f"data.file {cfg.file}",
        )

    def _order(self, epoch: int) -> list[int]:
        n = len(self.prompts)
        if not self.shuffle:
            return list(range(n))
        if epoch not in self._orders:
            if len(self._orders) > 4:
                self._orders.clear()
            g = torch.Generator().manual_seed(derive_seed(self.seed, epoch, 0, DOMAIN_DATA))
            self._orders[epoch] = torch.randperm(n, generator=g).tolist()
        return self._orders[epoch]

    def rows_for_step(self, step: int) -> list[int]:
        """The row indices of training step `step` (a pure function of (seed, step))."""
        n = len(self.prompts)
        out = []
        for i in range(self.per_step):
            k = step * self.per_step + i
            out.append(self._order(k // n)[k % n])
        return out

    def prompts_for_step(self, step: int) -> list[Any]:
        """The `per_step` distinct-slot prompts of training step `step`."""
        return [self.prompts[j] for j in self.rows_for_step(step)]

    @property
    def has_images(self) -> bool:
        """True when every row has an image."""
        return self.images is not None and all(im is not None for im in self.images)

    def missing_image(self) -> str | None:
        """Why the rows cannot feed an image-conditioned model (None when every row has an
        image): the source has no images, or the first row without one."""
        if self.images is None:
            if self.source == "data.prompts":
                return (
                    "data.prompts are text only: use a data.file whose rows carry an 'image' "
                    "(e.g. `omni-train prepare edit`)"
                )
            return f"{self.source} has no 'image' column / field"
        for im, prompt in zip(self.images, self.prompts):
            if im is None:
                return f"{self.source}: the row with prompt {prompt!r} has no 'image'"
        return None

    def image(self, row: int) -> np.ndarray:
        """Row `row`'s image as uint8 RGB (H, W, 3); RecipeError when it has none."""
        ref = None if self.images is None else self.images[row]
        if ref is None:
            raise RecipeError(f"{self.source}: row {row} has no 'image'")
        return ref.load()

    def images_for_step(self, step: int) -> list[np.ndarray]:
        """The images of `prompts_for_step(step)`, aligned with them."""
        return [self.image(j) for j in self.rows_for_step(step)]

    def val_image(self, i: int) -> np.ndarray:
        """The image of validation prompt `i`: row ``i mod N``'s (the validation prompts
        default to the first rows, so prompt and image come from the same row)."""
        return self.image(i % len(self.prompts))
