"""Strict JSON for request bodies: UTF-8, bounded nesting, bounded integers, finite numbers.

Python's ``json.loads`` accepts ``NaN`` and ``Infinity``, turns ``1e999`` into ``inf``, parses a
100,000-digit integer (or raises a bare ValueError past 4300 digits), and raises RecursionError
on deep nesting. A server must answer each of these with a 400 that names the field, so
`parse_json_body` parses with hooks that mark such values and then walks the result once
(iteratively) to report the first marked value or too-deep container by its JSON path, e.g.
``metadata[2].label`` or ``images[3]``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JSONBodyError", "parse_json_body"]

#: containers nested deeper than this are refused (a request needs 3 levels; metadata a few)
MAX_DEPTH = 32
#: integers with more digits than this are refused (2**63 has 19)
MAX_INT_DIGITS = 20


class JSONBodyError(ValueError):
    """A body that is not acceptable JSON; ``field`` is the JSON path of the problem."""

    def __init__(self, message: str, field: str = "body") -> None:
        super().__init__(message)
        self.field = field


class _Refused:
    """Stands in for a number the hooks refused until the walk reports it with its path."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parse_int(text: str) -> int | _Refused:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _Refused(f"an integer of {digits} digits is out of range")
    return int(text)


def _parse_float(text: str) -> float | _Refused:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        return _Refused(f"{text[:40]} overflows to infinity; a finite number is required")
    return value


def _parse_constant(text: str) -> _Refused:
    return _Refused(f"{text} is not a finite number; a finite number is required")


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent or 'body'}[{key}]"
    return f"{parent}.{key}" if parent else key


def parse_json_body(body: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse a request body; `JSONBodyError` naming the field for anything not acceptable."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONBodyError(f"body is not UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except json.JSONDecodeError as exc:
        raise JSONBodyError(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise JSONBodyError(f"body is nested deeper than {max_depth} levels") from None
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, _Refused):
            raise JSONBodyError(f"{where or 'body'}: {item.reason}", where or "body")
        if isinstance(item, (dict, list)):
            if depth >= max_depth:
                raise JSONBodyError(
                    f"{where or 'body'}: nested deeper than {max_depth} levels", where or "body"
                )
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            # reversed, so the walk reports the first bad value in document order
            stack.extend(reversed([(v, _path(where, k), depth + 1) for k, v in pairs]))
    return value
