"""The released models' configs, without weights: full-size architecture checks.

``omni_adapters/published/<name>.json`` holds, for each released model a recipe trains
(SD3.5-Medium, Qwen-Image, Qwen-Image-Edit, Qwen-Image-Edit-2511, Wan2.2 TI2V-5B and
T2V-A14B, LTX-2.3, BAGEL-7B-MoT, Qwen3-Omni-30B-A3B):

- ``repo_id``, ``family`` and the ``layout`` of the released folder;
- ``files``: the config files of the release (``model_index.json``, each component's
  ``config.json``, BAGEL's ``llm_config.json`` / ``vit_config.json``...), with
  ``provenance`` saying where each came from (the release's own file, or derived from the
  official code's defaults and the model card where no copy was found);
- ``checks``: published parameter counts (``published``, ``digits`` significant digits as
  published, ``source``) and which modules they cover;
- ``frozen_params``: published sizes of components whose config is not here (for the memory
  estimate), ``geometry``: latent/patch factors and text lengths (tokens per sample).

:func:`build_meta` writes the files to a folder and loads it through the adapter's own
``from_pretrained(path, device="meta")``: every module at full size, no weights. Counts are
checkpoint tensors (parameters plus persistent buffers: what a released file holds).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

__all__ = [
    "PUBLISHED_DIR",
    "CheckResult",
    "PublishedModel",
    "build_meta",
    "checkpoint_count",
    "frozen_published",
    "full_transformers_model",
    "load",
    "match_path",
    "names",
    "run_checks",
    "write_config_folder",
]

PUBLISHED_DIR = Path(__file__).parent / "published"


@dataclass(frozen=True)
class PublishedModel:
    """One released model's configs and published sizes (see the module docstring)."""

    name: str
    repo_id: str
    family: str
    layout: str
    files: dict[str, Any]
    checks: list[dict[str, Any]]
    provenance: dict[str, str] = field(default_factory=dict)
    frozen_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    geometry: dict[str, Any] = field(default_factory=dict)
    stage: str | None = None


def names() -> list[str]:
    """The published models (file stems of ``omni_adapters/published``)."""
    return sorted(p.stem for p in PUBLISHED_DIR.glob("*.json"))


def load(name: str) -> PublishedModel:
    """A published model by name (``sd35_medium``) or repo id (``stabilityai/...``, any case)."""
    wanted = name.lower()
    for stem in names():
        data = json.loads((PUBLISHED_DIR / f"{stem}.json").read_text())
        if wanted in (stem, data["repo_id"].lower()):
            return PublishedModel(name=stem, **data)
    raise ValueError(f"published: unknown model {name!r}; known: {names()}")


def match_path(path: str | os.PathLike[str]) -> PublishedModel | None:
    """The published model whose repo name is the folder's name (``~/models/Qwen-Image`` ->
    ``Qwen/Qwen-Image``; case-insensitive, a ``-Diffusers`` suffix optional on either side),
    or None."""

    def key(name: str) -> str:
        return name.lower().removesuffix("-diffusers")

    base = key(Path(os.path.expanduser(str(path))).name)
    for stem in names():
        m = load(stem)
        if key(m.repo_id.split("/")[-1]) == base:
            return m
    return None


def write_config_folder(model: PublishedModel, root: str | os.PathLike[str]) -> Path:
    """Write the model's config files under ``root`` (created) and return it."""
    root = Path(root)
    for rel, content in model.files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(content, indent=1) + "\n")
    return root


def build_meta(model: PublishedModel | str, **options: Any) -> Any:
    """The model's adapter built at full size on the meta device through
    ``omni_adapters.from_pretrained(folder, device="meta")`` (the adapter's own setup path)."""
    from .base import from_pretrained

    if isinstance(model, str):
        model = load(model)
    if model.stage is not None:
        options.setdefault("stage", model.stage)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config_folder(model, Path(tmp) / model.name)
        return from_pretrained(folder, device="meta", **options)


def checkpoint_count(module: nn.Module, exclude: Sequence[str] = ()) -> int:
    """Elements of ``module``'s state dict (parameters and persistent buffers), leaving out
    names containing any of ``exclude``."""
    return sum(
        t.numel() for k, t in module.state_dict().items() if not any(e in k for e in exclude)
    )


def _submodule(adapter: Any, dotted: str) -> nn.Module:
    comp, _, rest = dotted.partition(".")
    if comp not in adapter.components:
        raise ValueError(f"checks: no component {comp!r}; have {sorted(adapter.components)}")
    m = adapter.components[comp]
    return m.get_submodule(rest) if rest else m


def _rounds_to(n: float, published: float, digits: int) -> bool:
    """Whether ``n`` written with ``digits`` significant digits is ``published``."""
    if n <= 0:
        return False
    scale = 10 ** (math.floor(math.log10(abs(published))) - digits + 1)
    return round(n / scale) * scale == round(published / scale) * scale


@dataclass(frozen=True)
class CheckResult:
    """One published-size check: the count here, the published figure and how far apart."""

    name: str
    counted: int
    published: float
    digits: int
    source: str

    @property
    def rel_diff(self) -> float:
        return abs(self.counted - self.published) / self.published

    @property
    def rounds_to_published(self) -> bool:
        return _rounds_to(self.counted, self.published, self.digits)

    @property
    def ok(self) -> bool:
        """Within 1% of the published figure, or equal to it at its published precision (a
        card's "2.5B" stands for 2.45B-2.55B)."""
        return self.rel_diff <= 0.01 or self.rounds_to_published


def run_checks(model: PublishedModel, adapter: Any | None = None) -> list[CheckResult]:
    """Count the modules each published check covers (``adapter``: a :func:`build_meta`
    result; built here if None). A check with ``full_model`` counts the whole transformers
    checkpoint (e.g. Qwen3-Omni's thinker + talker + code2wav) built on meta from
    ``config.json``."""
    if adapter is None and any(not c.get("full_model") for c in model.checks):
        adapter = build_meta(model)
    out = []
    for c in model.checks:
        if c.get("full_model"):
            n = checkpoint_count(full_transformers_model(model))
        else:
            n = sum(
                checkpoint_count(_submodule(adapter, m), c.get("exclude", ())) for m in c["modules"]
            )
        out.append(CheckResult(c["name"], n, float(c["published"]), int(c["digits"]), c["source"]))
    return out


def full_transformers_model(model: PublishedModel) -> nn.Module:
    """The whole transformers model of ``config.json`` (e.g. Qwen3-Omni with its talker and
    code2wav), built on the meta device."""
    import torch
    import transformers

    cfg_data = model.files["config.json"]
    arch = cfg_data["architectures"][0]
    klass = getattr(transformers, arch)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg_data))
        config = klass.config_class.from_pretrained(tmp)
    with torch.device("meta"):
        return klass._from_config(config)


def frozen_published(model: PublishedModel, present: Iterable[str]) -> dict[str, float]:
    """Published sizes of the components not built from a config (``present`` are)."""
    have = set(present)
    return {k: float(v["params"]) for k, v in model.frozen_params.items() if k not in have}
