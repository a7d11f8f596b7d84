r"""Text rewards for reasoning answers: ``math`` (MMK12-style) and ``choice``.

``math``: for a response ``y`` and a reference answer ``a``,

    accuracy = 1 if extract(y) is equivalent to a else 0
    format   = 0.3 if y is well formed else 0
    score    = (accuracy + format) / 1.3                     (in [0, 1])

A response is well formed when it is ``<think>...</think>`` (optional) followed by one
``<answer>...</answer>`` block with non-empty content, and nothing else. ``extract(y)`` is the
content of the first ``<answer>`` block (the last ``\boxed{...}`` inside it when there is one),
else the last ``\boxed{...}`` anywhere in ``y``. Equivalence, in order: a letter choice A-E
when the reference is one; numbers (integers, decimals, ``1,000``, ``50%``, ``3/4``,
``\frac{3}{4}``) within a relative 1e-6; symbolic equality with math-verify when installed,
else sympy (``simplify(p - a) == 0``); else the normalised strings are equal. This follows the
rule-based rewards of MMK12 / MM-Eureka (Meng et al. 2025) and DeepSeek-R1 (accuracy + format).

``choice``: score = 1 if the letter chosen in the response equals the reference letter, else 0.

Inputs: ``texts`` (the model's responses) and ``references`` (the ground-truth answers).
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

import numpy as np

from .base import Reward, require_module
from .types import RewardInput, RewardInputError, RewardOutput

__all__ = [
    "ChoiceReward",
    "MathReward",
    "answers_equivalent",
    "extract_answer",
    "extract_boxed",
    "extract_choice",
    "is_well_formed",
    "parse_number",
]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_WELL_FORMED = re.compile(
    r"\s*(?:<think>.*?</think>\s*)?<answer>(.*?)</answer>\s*", re.DOTALL | re.IGNORECASE
)


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``) in ``text``, braces balanced."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    i = starts[-1]
    depth, j = 1, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
        j += 1
    return None


def extract_answer(text: str) -> str | None:
    r"""The answer: first ``<answer>`` block (its last ``\boxed{}`` if any), else last ``\boxed{}``."""
    m = _ANSWER.search(text)
    if m is not None:
        inner = m.group(1)
        boxed = extract_boxed(inner)
        return (boxed if boxed is not None else inner).strip()
    return extract_boxed(text)


def is_well_formed(text: str) -> bool:
    """``<think>...</think>`` (optional) then one non-empty ``<answer>...</answer>``, nothing else."""
    m = _WELL_FORMED.fullmatch(text)
    if m is None or not m.group(1).strip():
        return False
    return len(_ANSWER.findall(text)) == 1


_CHOICE_PATTERNS = [
    re.compile(r"^\(?([A-E])\)?[.):]?$"),
    re.compile(r"^\(?([A-E])\)?[.):]?\s+\S"),
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*:?\s*\(?([A-E])\)?\b", re.IGNORECASE),
    re.compile(r"\(([A-E])\)"),
]


def extract_choice(text: str, letters: str = "ABCDE") -> str | None:
    """The letter chosen in ``text`` ("B", "(B)", "B. 42", "the answer is C", ...), or None."""
    s = _strip_latex(text).strip()
    for pat in _CHOICE_PATTERNS:
        m = pat.search(s)
        if m is not None and m.group(1).upper() in letters:
            return m.group(1).upper()
    return None


def _strip_latex(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(
        r"\\text\{([^{}]*)\}|\\mathrm\{([^{}]*)\}", lambda m: m.group(1) or m.group(2) or "", s
    )
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.strip()


def _normalise(s: str) -> str:
    s = _strip_latex(s)
    s = re.sub(r"^(?:the\s+)?(?:final\s+)?answer\s*(?:is|:)\s*", "", s, flags=re.IGNORECASE)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
    s = s.rstrip(".").replace(" ", "")
    return s.lower()


def parse_number(s: str) -> Fraction | float | None:
    r"""A number from ``s``: ``42``, ``-3.5``, ``1,000``, ``50%``, ``3/4``, ``\frac{3}{4}``, or None."""
    t = _normalise(s)
    t = re.sub(r"\^\{?\\circ\}?|°", "", t)
    percent = t.endswith("%") or t.endswith("\\%")
    t = t.removesuffix("\\%").removesuffix("%")
    m = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", t)
    if m is not None:
        t = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", t):
        t = t.replace(",", "")
    try:
        value: Fraction | float = Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def _sympy_equal(pred: str, ref: str) -> bool | None:
    try:
        import sympy
        from sympy.parsing.sympy_parser import (
            implicit_multiplication_application,
            parse_expr,
            standard_transformations,
        )
    except ImportError:
        return None

    def to_py(s: str) -> str:
        s = _strip_latex(s)
        for _ in range(3):
            s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
            s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
        s = (
            s.replace("\\cdot", "*")
            .replace("\\times", "*")
            .replace("\\pi", "pi")
            .replace("^", "**")
        )
        return s.replace("{", "(").replace("}", ")").replace("\\", "")

    tr = (*standard_transformations, implicit_multiplication_application)
    try:
        a = parse_expr(to_py(pred), transformations=tr, evaluate=True)
        b = parse_expr(to_py(ref), transformations=tr, evaluate=True)
        return bool(sympy.simplify(a - b) == 0)
    except Exception:
        return None


def _math_verify_equal(pred: str, ref: str) -> bool | None:
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    main = threading.current_thread() is threading.main_thread()
    t = 5 if main else None  # math-verify's timeout uses SIGALRM, main thread only
    try:
        gold = parse(f"${ref}$", parsing_timeout=t)
        answer = parse(f"${pred}$", parsing_timeout=t)
        if not gold or not answer:
            return None
        return bool(verify(gold, answer, timeout_seconds=t))
    except Exception:
        return None


def answers_equivalent(pred: str | None, ref: str, *, letters: str = "ABCDE") -> bool:
    """Whether the extracted answer ``pred`` matches the reference ``ref`` (rules above)."""
    if pred is None or not pred.strip():
        return False
    ref_choice = (
        extract_choice(ref, letters) if re.fullmatch(r"\s*\(?[A-Ea-e]\)?[.):]?\s*", ref) else None
    )
    if ref_choice is not None:
        return extract_choice(pred, letters) == ref_choice
    if _normalise(pred) == _normalise(ref):
        return True
    a, b = parse_number(pred), parse_number(ref)
    if a is not None and b is not None:
        return abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
    for check in (_math_verify_equal, _sympy_equal):
        res = check(pred, ref)
        if res is not None:
            return res
    return False


def _references(inp: RewardInput, reward: str) -> list[str]:
    refs = inp.require("references", reward)
    out = []
    for i, r in enumerate(refs):
        if isinstance(r, int | float) and not isinstance(r, bool):
            r = str(r)
        if not isinstance(r, str):
            raise RewardInputError(
                f"references[{i}]: expected the reference answer as str, got {r!r}"
            )
        out.append(r)
    return out


class MathReward(Reward):
    """``math`` reward: (accuracy + format) / 1.3; see the module docstring.

    Options: ``format_weight`` (0.3), ``letters`` ("ABCDE"). Details: ``accuracy``,
    ``format``, ``answer`` (the extracted answer).
    """

    name = "math"

    def __init__(
        self,
        *,
        format_weight: float = 0.3,
        letters: str = "ABCDE",
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, workers=workers)
        require_module("sympy", "math", "math")  # symbolic equivalence; math-verify when present
        if format_weight < 0:
            raise ValueError(f"format_weight: must be >= 0, got {format_weight}")
        self.format_weight = float(format_weight)
        self.letters = letters

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        texts = inp.text_list(self.name)
        refs = _references(inp, self.name)
        acc, fmt, answers = [], [], []
        for text, ref in zip(texts, refs):
            ans = extract_answer(text)
            answers.append("" if ans is None else ans)
            acc.append(1.0 if answers_equivalent(ans, ref, letters=self.letters) else 0.0)
            fmt.append(self.format_weight if is_well_formed(text) else 0.0)
        a, f = np.array(acc, np.float32), np.array(fmt, np.float32)
        scores = (a + f) / (1.0 + self.format_weight)
        return RewardOutput(
            scores, {"accuracy": a, "format": f, "answer": np.array(answers, dtype=object)}
        )


class ChoiceReward(Reward):
    """``choice`` reward: 1 if the chosen letter equals the reference letter, else 0.

    The letter comes from the ``<answer>`` block / ``\\boxed{}`` when present, else from the
    whole response ("the answer is (C)"). Details: ``choice`` (the letter, "" if none).
    """

    name = "choice"

    def __init__(self, *, letters: str = "ABCDE", batch_size: int | None = None, workers: int = 1):
        super().__init__(batch_size=batch_size, workers=workers)
        self.letters = letters

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        texts = inp.text_list(self.name)
        refs = _references(inp, self.name)
        scores, chosen = [], []
        for i, (text, ref) in enumerate(zip(texts, refs)):
            want = extract_choice(ref, self.letters)
            if want is None:
                raise RewardInputError(
                    f"references[{i}]: {ref!r} is not a letter in {self.letters}"
                )
            ans = extract_answer(text)
            got = extract_choice(ans if ans is not None else text, self.letters)
            chosen.append(got or "")
            scores.append(1.0 if got == want else 0.0)
        return RewardOutput(
            np.array(scores, np.float32), {"choice": np.array(chosen, dtype=object)}
        )
