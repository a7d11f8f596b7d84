"""`key=value` options from the command line (shared by the `omni-rewards` subcommands)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["parse_options"]


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``["batch_size=4", "backend=rapidocr"]`` -> ``{"batch_size": 4, "backend": "rapidocr"}``.

    Values are parsed as JSON when they can be, else kept as strings.
    """
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--option {item!r}: expected key=value")
        key, value = item.split("=", 1)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
