"""Strict checkpoint reading: every tensor a checkpoint holds is used, every parameter is set.

diffusers and transformers load a checkpoint with a missing or renamed tensor anyway (they
initialise the parameter at random and log a warning); a released checkpoint whose names do
not match the module tree would then train a half-random model. Every loader in this package
goes through :func:`check_keys` (own modules) or :func:`check_loading_info` (diffusers /
transformers ``from_pretrained(..., output_loading_info=True)``), which turn any missing,
unexpected or mis-shaped tensor into a :class:`CheckpointKeyError` that lists them by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "CheckpointKeyError",
    "check_keys",
    "check_loading_info",
    "load_state_strict",
    "read_safetensors",
    "safetensors_keys",
]

#: how many names an error message lists per kind (the count is always given)
SHOWN = 12


class CheckpointKeyError(ValueError):
    """A checkpoint does not match the module it is loaded into; ``missing``,
    ``unexpected`` and ``mismatched`` hold the offending names."""

    def __init__(
        self,
        source: str,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        mismatched: Iterable[str] = (),
    ) -> None:
        self.source = source
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = sorted(mismatched)
        parts = []
        for label, names in (
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("shape mismatch", self.mismatched),
        ):
            if names:
                more = f" (+{len(names) - SHOWN} more)" if len(names) > SHOWN else ""
                parts.append(f"{len(names)} {label}: {', '.join(names[:SHOWN])}{more}")
        super().__init__(f"{source}: checkpoint does not match the model; " + "; ".join(parts))


def safetensors_keys(path: str | os.PathLike[str]) -> list[str]:
    """Tensor names in a ``.safetensors`` file (reads the header only)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        return list(fh.keys())


def check_keys(
    source: str,
    expected: Iterable[str],
    found: Iterable[str],
    *,
    shapes: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
) -> None:
    """Raise :class:`CheckpointKeyError` unless ``found`` names exactly ``expected``; with
    ``shapes=(expected_shapes, found_shapes)`` also compare the shapes of the common names."""
    exp, got = set(expected), set(found)
    mismatched: list[str] = []
    if shapes is not None:
        want, have = shapes
        mismatched = [
            f"{k} {tuple(have[k])} != {tuple(want[k])}"
            for k in sorted(exp & got)
            if tuple(want[k]) != tuple(have[k])
        ]
    if exp != got or mismatched:
        raise CheckpointKeyError(source, exp - got, got - exp, mismatched)


def check_loading_info(
    source: str, info: Mapping[str, Any], *, allow_unexpected: Iterable[str] = ()
) -> None:
    """Raise on the ``output_loading_info`` report of a diffusers / transformers
    ``from_pretrained``: any missing, unexpected (except names starting with one of
    ``allow_unexpected``, parts of the checkpoint this stage deliberately does not build) or
    mismatched key."""
    allowed = tuple(allow_unexpected)
    missing = set(info.get("missing_keys") or ())
    unexpected = {k for k in info.get("unexpected_keys") or () if not k.startswith(allowed)}
    mismatched = {m if isinstance(m, str) else str(m[0]) for m in info.get("mismatched_keys") or ()}
    errors = [str(e) for e in info.get("error_msgs") or ()]
    if missing or unexpected or mismatched:
        raise CheckpointKeyError(source, missing, unexpected, mismatched)
    if errors:
        raise ValueError(f"{source}: {errors[0]}")


def load_state_strict(
    module: nn.Module,
    state: Mapping[str, torch.Tensor],
    source: str,
    *,
    rename: Callable[[str], str] | None = None,
    assign: bool = False,
) -> None:
    """Copy ``state`` (names optionally mapped by ``rename``) into ``module``: the names must
    be exactly the module's ``state_dict`` names and every shape must match, otherwise
    :class:`CheckpointKeyError` lists the differences."""
    if rename is not None:
        renamed: dict[str, torch.Tensor] = {}
        for k, v in state.items():
            new = rename(k)
            if new in renamed:
                raise CheckpointKeyError(source, unexpected=[f"{k} (duplicates {new})"])
            renamed[new] = v
        state = renamed
    own = module.state_dict()
    check_keys(
        source,
        own,
        state,
        shapes=({k: v.shape for k, v in own.items()}, {k: v.shape for k, v in state.items()}),
    )
    module.load_state_dict(dict(state), strict=True, assign=assign)


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of a ``.safetensors`` file (CPU)."""
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such checkpoint file")
    return load_file(str(p))
