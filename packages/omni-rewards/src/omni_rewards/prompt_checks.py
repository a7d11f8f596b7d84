"""What a reward needs its prompts to say, checked before any model is loaded.

Some rewards read their target from the prompt: `color_match` a palette colour, `ocr` the text
in double quotes. `check_prompts(name, prompts, options)` finds the prompts such a reward could
not score, without building the reward, so a trainer can refuse a recipe at validation instead
of failing at its first step. Rewards register a check with `register_prompt_check`; a reward
without one accepts any prompt.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PROMPT_CHECKS", "check_prompts", "register_prompt_check"]

#: reward name -> check(prompt, options) -> why it cannot be scored, or None
PROMPT_CHECKS: dict[str, Callable[[str, dict[str, Any]], str | None]] = {}

#: modules whose import registers the checks of lazily loaded rewards
_CHECK_MODULES = {"ocr": ".ocr", "shapes": ".shapes"}


def register_prompt_check(
    name: str,
) -> Callable[
    [Callable[[str, dict[str, Any]], str | None]], Callable[[str, dict[str, Any]], str | None]
]:
    """Decorator: ``@register_prompt_check("my_reward")`` on ``check(prompt, options)``."""

    def deco(
        fn: Callable[[str, dict[str, Any]], str | None],
    ) -> Callable[[str, dict[str, Any]], str | None]:
        PROMPT_CHECKS[name] = fn
        return fn

    return deco


def check_prompts(
    name: str, prompts: Sequence[str], options: dict[str, Any] | None = None
) -> list[str]:
    """``"prompts[i] 'the prompt': why"`` for each prompt reward `name` could not score with
    these `options` (empty: all fine, or the reward reads no target from its prompts)."""
    if name in _CHECK_MODULES and name not in PROMPT_CHECKS:
        importlib.import_module(_CHECK_MODULES[name], __package__)
    check = PROMPT_CHECKS.get(name)
    if check is None:
        return []
    problems = []
    for i, p in enumerate(prompts):
        why = check(p, dict(options or {}))
        if why is not None:
            problems.append(f"prompts[{i}] {p!r}: {why}")
    return problems
