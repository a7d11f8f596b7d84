"""`omni-train recipes list` and `omni-train recipes copy NAME [--to DIR] [--force]`.

The repository's ``recipes/`` folder ships inside the omni-train wheel as ``omni_train/recipes``
(``packages/omni-train/hatch_build.py``), so a pip install has every recipe without a clone.
``copy`` writes the recipe to ``DIR/recipes/NAME.yaml``: the path the recipe's own comments and
the README use, so ``omni-train recipes/quickstart.yaml`` runs as written from DIR. The data
folders a recipe reads from ``recipes/data/``, and the model folders from ``recipes/models/``
(the shapes world's toy SD3), come with it; for the datasets ``omni-train
prepare`` writes (``data/<name>/``) it prints the command to make them.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from .recipe import RecipeError

__all__ = ["ShippedRecipe", "copy_recipe", "main", "recipes_root", "shipped_recipes"]


# folders under recipes/ that hold what recipes read (prompt files, images, model weights), not
# recipes; `copy_recipe` copies the ones a recipe names
SHIPPED_FOLDERS = ("data", "models")


@dataclass(frozen=True)
class ShippedRecipe:
    """A recipe that ships with omni-train."""

    name: str  # "quickstart", "cpu/sd35_ocr_lora_flowgrpo": its path under recipes/, no .yaml
    path: Path
    summary: str  # "model, algorithm, reward, LoRA rank"


def recipes_root() -> Path:
    """The folder of the shipped recipes: the wheel's ``omni_train/recipes``, or, in an editable
    install from a checkout (which has no copy), the checkout's ``recipes/``."""
    packaged = Path(__file__).resolve().parent / "recipes"
    checkout = Path(__file__).resolve().parents[4] / "recipes"  # src/omni_train -> repo root
    for root in (packaged, checkout):
        if (root / "quickstart.yaml").is_file():
            return root
    raise RecipeError(
        f"no shipped recipes found (looked in {packaged} and {checkout}); reinstall omni-train"
    )


def _summary(recipe: dict[str, Any]) -> str:
    """``model, algorithm, reward, LoRA rank``, read from the recipe itself, e.g.
    ``stable-diffusion-3.5-medium, flow_grpo, reward ocr, LoRA r32``."""
    model = recipe.get("model") or {}
    if model.get("tiny"):
        parts = [f"tiny random {model['tiny']} (CPU)"]
    else:
        parts = [PurePosixPath(str(model.get("path", "?"))).name]
    parts.append(str((recipe.get("algorithm") or {}).get("name", "?")))
    reward = recipe.get("reward") or {}
    terms = reward.get("terms") or []
    names = [reward["name"]] if "name" in reward else [term.get("name") for term in terms]
    parts.append("reward " + " + ".join(map(str, names)))
    lora = recipe.get("lora") or {}
    parts.append(f"LoRA r{lora['rank']}" if lora.get("rank") else "full fine-tuning")
    return ", ".join(parts)


def _load(path: Path) -> dict[str, Any]:
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:  # a shipped recipe is valid YAML: a broken install
        raise RecipeError(f"recipes: {path} is not valid YAML: {exc}") from None


def shipped_recipes() -> list[ShippedRecipe]:
    """Every recipe under the recipes folder (``data/`` excluded), sorted by name."""
    root = recipes_root()
    found = []
    for path in sorted(root.rglob("*.yaml")):
        rel = path.relative_to(root)
        if rel.parts[0] in SHIPPED_FOLDERS:
            continue
        found.append(ShippedRecipe(rel.with_suffix("").as_posix(), path, _summary(_load(path))))
    return found


def _find(name: str) -> ShippedRecipe:
    recipes = {r.name: r for r in shipped_recipes()}
    key = name.removesuffix(".yaml").removeprefix("recipes/")
    if key in recipes:
        return recipes[key]
    close = difflib.get_close_matches(key, list(recipes), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise RecipeError(
        f"recipes copy: no recipe {name!r}{hint}; `omni-train recipes list` shows them all"
    )


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _shipped_folders(recipe: dict[str, Any]) -> list[str]:
    """The ``recipes/data/<name>`` and ``recipes/models/<name>`` folders the recipe's values
    point into, e.g. ``recipes/data/edit_tiny/train.jsonl`` -> ``data/edit_tiny`` (relative to
    recipes/)."""
    folders = set()
    for text in _strings(recipe):
        parts = PurePosixPath(text).parts
        if len(parts) >= 3 and parts[0] == "recipes" and parts[1] in SHIPPED_FOLDERS:
            folders.add(f"{parts[1]}/{parts[2]}")
    return sorted(folders)


def _prepare_hints(recipe: dict[str, Any], to: Path) -> list[str]:
    """``omni-train prepare NAME`` for each ``data/NAME/...`` file the recipe reads that DIR
    does not have yet."""
    from .prepare import DATASETS, IMAGE_DATASETS

    data = recipe.get("data") or {}
    names = []
    for key in ("file", "val_file"):
        parts = PurePosixPath(str(data.get(key) or "")).parts
        if len(parts) >= 3 and parts[0] == "data" and not (to / Path(*parts)).exists():
            name = parts[1]
            if (name in DATASETS or name in IMAGE_DATASETS) and name not in names:
                names.append(name)
    return [f"omni-train prepare {name}" for name in names]


def copy_recipe(name: str, to: str | Path = ".", *, force: bool = False) -> list[Path]:
    """Copy recipe ``name`` (and the ``recipes/data`` and ``recipes/models`` folders it reads)
    under ``to``; returns the written recipe path first, then those folders. Refuses, changing
    nothing, when a target exists and ``force`` is false."""
    recipe = _find(name)
    root = recipes_root()
    to = Path(to).expanduser()
    content = _load(recipe.path)
    sources = [recipe.path, *(root / folder for folder in _shipped_folders(content))]
    targets = [to / "recipes" / src.relative_to(root) for src in sources]
    existing = [t for t in targets if t.exists()]
    if existing and not force:
        raise RecipeError(
            f"recipes copy: {existing[0]} exists; pass --force to overwrite it, or --to another "
            "folder"
        )
    for src, dst in zip(sources, targets):
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copyfile(src, dst)
    return targets


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-train recipes", description="The recipes that ship with omni-train."
    )
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="list the shipped recipes (cpu/*: CPU twins, tiny models)")
    c = sub.add_parser(
        "copy",
        help="copy a recipe to DIR/recipes/NAME.yaml",
        description="Copy a shipped recipe to DIR/recipes/NAME.yaml (with the recipes/data "
        "and recipes/models folders it reads), so `omni-train recipes/NAME.yaml` runs from DIR.",
    )
    c.add_argument("name", help="recipe name, as `omni-train recipes list` prints it")
    c.add_argument("--to", default=".", help="destination folder (default: the current one)")
    c.add_argument("--force", action="store_true", help="overwrite files that exist")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``omni-train recipes``; errors print one line and return 2."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.action == "list":
            recipes = shipped_recipes()
            width = max(len(r.name) for r in recipes)
            for r in recipes:
                print(f"{r.name:<{width}}  {r.summary}".rstrip())
            return 0
        written = copy_recipe(args.name, args.to, force=args.force)
    except RecipeError as exc:
        print(f"omni-train: error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    recipe_rel = written[0].relative_to(Path(args.to).expanduser())
    content = _load(written[0])
    steps = _prepare_hints(content, Path(args.to).expanduser())
    steps.append(f"omni-train {recipe_rel.as_posix()}")
    where = "" if Path(args.to) == Path(".") else f"cd {args.to} && "
    print(f"run it: {where}{' && '.join(steps)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
