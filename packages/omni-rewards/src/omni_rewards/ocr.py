"""``ocr``: does the image show the text the prompt asks for?

Target text: the text between the first pair of double quotes in the prompt (straight ``"``
or curly quotes), or ``references[i]`` when given. Recognised text: every line that
rapidocr (PP-OCR ONNX models that ship in the rapidocr wheel, so it works offline) reads,
in reading order, concatenated. Both are lowercased with all whitespace removed, then

    d = 0                                    if target is a substring of recognised
    d = min(Levenshtein(recognised, target), len(target))   otherwise
    score = 1 - d / len(target)

An empty target scores 1 when nothing was read, else 0. Videos score the mean over
``video_frames`` evenly spaced frames. This is the OCR reward of Flow-GRPO (Liu et al. 2025,
"Flow-GRPO: Training Flow Matching Models via Online RL").
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import Reward, require_module
from .prompt_checks import register_prompt_check
from .types import RewardInput, RewardInputError, RewardOutput

__all__ = ["OCRReward", "extract_target", "levenshtein", "normalize_text", "ocr_score"]

_QUOTES = re.compile(r'"([^"]*)"|“([^”]*)”')


@register_prompt_check("ocr")
def _has_quoted_text(prompt: str, options: dict[str, Any]) -> str | None:
    if options.get("missing_target", "error") == "empty" or extract_target(prompt) is not None:
        return None
    return "has no text in double quotes for ocr to read; quote it, or set missing_target: empty"


def extract_target(prompt: str) -> str | None:
    """Text between the first pair of double quotes (straight or curly), or None."""
    m = _QUOTES.search(prompt)
    if m is None:
        return None
    return m.group(1) if m.group(1) is not None else m.group(2)


def normalize_text(text: str) -> str:
    """Lowercase and remove all whitespace."""
    return re.sub(r"\s+", "", text).lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_score(recognized: str, target: str) -> float:
    """score = 1 - min(d, len(t)) / len(t), d = 0 if t is a substring else Levenshtein."""
    rec, tgt = normalize_text(recognized), normalize_text(target)
    if not tgt:
        return 1.0 if not rec else 0.0
    d = 0 if tgt in rec else min(levenshtein(rec, tgt), len(tgt))
    return 1.0 - d / len(tgt)


def _reading_order(boxes: np.ndarray, texts: Sequence[str]) -> list[str]:
    """Sort text boxes into lines (by vertical centre) and each line left to right."""
    if len(texts) <= 1:
        return list(texts)
    b = np.asarray(boxes, dtype=np.float64).reshape(len(texts), -1, 2)
    cy = b[:, :, 1].mean(axis=1)
    h = b[:, :, 1].max(axis=1) - b[:, :, 1].min(axis=1)
    x0 = b[:, :, 0].min(axis=1)
    order = np.argsort(cy, kind="stable")
    lines: list[list[int]] = []
    for i in order:
        if lines and abs(cy[i] - np.mean([cy[j] for j in lines[-1]])) < 0.5 * max(h[i], 1.0):
            lines[-1].append(int(i))
        else:
            lines.append([int(i)])
    return [texts[i] for line in lines for i in sorted(line, key=lambda k: x0[k])]


class _RapidBackend:
    """rapidocr with the bundled ONNX models (onnxruntime on CPU)."""

    def __init__(self, params: dict[str, Any] | None, min_confidence: float) -> None:
        rapidocr = require_module("rapidocr", "ocr", "ocr")
        require_module("onnxruntime", "ocr", "ocr")
        defaults = {
            "Global.log_level": "error",
            "Global.use_cls": False,
            "Det.limit_type": "max",
            "Det.limit_side_len": 960,
        }
        self.engine = rapidocr.RapidOCR(params={**defaults, **(params or {})})
        self.min_confidence = float(min_confidence)
        self.lock = threading.Lock()

    def _join(self, boxes: Any, texts: Sequence[str], scores: Sequence[float]) -> str:
        if not texts:
            return ""
        thresh = max(self.min_confidence, float(self.engine.cfg.Global.text_score))
        keep = [i for i, (t, s) in enumerate(zip(texts, scores)) if s >= thresh and t.strip()]
        kept = [texts[i] for i in keep]
        if boxes is not None and len(keep):
            return " ".join(_reading_order(np.asarray(boxes)[keep], kept))
        return " ".join(kept)

    def read(self, image: np.ndarray) -> str:
        bgr = np.ascontiguousarray(image[..., ::-1])
        with self.lock:
            res = self.engine(bgr)
        texts = list(getattr(res, "txts", None) or [])
        scores = list(getattr(res, "scores", None) or [1.0] * len(texts))
        return self._join(getattr(res, "boxes", None), texts, scores)

    def read_many(self, images: list[np.ndarray]) -> list[str]:
        """Detect per image, then recognise the text lines of all images in shared batches."""
        eng = self.engine
        needed = ("preprocess_img", "detect_and_crop", "recognize_txt", "load_img")
        if len(images) == 1 or not all(hasattr(eng, a) for a in needed):
            return [self.read(im) for im in images]
        with self.lock:
            crops: list[np.ndarray] = []
            spans, boxes = [], []
            for im in images:
                img, record = eng.preprocess_img(eng.load_img(np.ascontiguousarray(im[..., ::-1])))
                try:
                    cropped, det = eng.detect_and_crop(img, record)
                except Exception:
                    cropped, det = [], None
                spans.append((len(crops), len(crops) + len(cropped)))
                boxes.append(None if det is None else det.boxes)
                crops.extend(cropped)
            rec = eng.recognize_txt(crops) if crops else None
        texts = list(rec.txts) if rec is not None and rec.txts is not None else []
        scores = list(rec.scores) if rec is not None and rec.scores is not None else []
        return [self._join(b, texts[a:e], scores[a:e]) for (a, e), b in zip(spans, boxes)]


class _PaddleBackend:
    """PaddleOCR (extra ``paddleocr``) for users who have its models locally."""

    def __init__(self, params: dict[str, Any] | None, min_confidence: float) -> None:
        paddleocr = require_module("paddleocr", "paddleocr", "ocr")
        opts = {"use_textline_orientation": False, **(params or {})}
        self.engine = paddleocr.PaddleOCR(**opts)
        self.min_confidence = float(min_confidence)
        self.lock = threading.Lock()

    def read(self, image: np.ndarray) -> str:
        with self.lock:
            results = self.engine.predict(np.ascontiguousarray(image[..., ::-1]))
        parts: list[str] = []
        for res in results or []:
            data = res if isinstance(res, dict) else getattr(res, "json", {}).get("res", {})
            texts = data.get("rec_texts", []) or []
            scores = data.get("rec_scores", [1.0] * len(texts)) or [1.0] * len(texts)
            parts += [t for t, s in zip(texts, scores) if s >= self.min_confidence]
        return " ".join(parts)


_BACKENDS = {"rapidocr": _RapidBackend, "paddleocr": _PaddleBackend}


class OCRReward(Reward):
    """OCR reward; see the module docstring for the formula.

    Inputs: ``images`` or ``videos``; ``prompts`` (target in double quotes) or ``references``
    (the target text itself). Options: ``backend`` ("rapidocr" default, or "paddleocr"),
    ``params`` (backend settings, e.g. ``{"Det.limit_side_len": 1280}`` for rapidocr),
    ``min_confidence`` (drop recognised lines below it), ``video_frames`` (frames sampled per
    video), ``missing_target`` ("error" or "empty": what to do with a prompt without quotes).
    ``details["text"]`` holds the recognised text.
    """

    name = "ocr"
    default_batch_size = 16

    def __init__(
        self,
        *,
        backend: str = "rapidocr",
        params: dict[str, Any] | None = None,
        min_confidence: float = 0.0,
        video_frames: int = 4,
        missing_target: str = "error",
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, workers=workers)
        if backend not in _BACKENDS:
            raise ValueError(f"backend: expected one of {sorted(_BACKENDS)}, got {backend!r}")
        if missing_target not in ("error", "empty"):
            raise ValueError(f"missing_target: expected 'error' or 'empty', got {missing_target!r}")
        if int(video_frames) < 1:
            raise ValueError(f"video_frames: must be >= 1, got {video_frames}")
        self.backend = _BACKENDS[backend](params, min_confidence)
        self.video_frames = int(video_frames)
        self.missing_target = missing_target

    def targets(self, inp: RewardInput) -> list[str]:
        if inp.references is not None:
            out = []
            for i, r in enumerate(inp.references):
                if not isinstance(r, str):
                    raise RewardInputError(
                        f"references[{i}]: expected the target text (str), got {r!r}"
                    )
                out.append(r)
            return out
        if inp.prompts is None:
            raise RewardInputError(
                "prompts: ocr needs `prompts` with the target text in double quotes, or `references`"
            )
        out = []
        for i, p in enumerate(inp.prompt_list(self.name)):
            t = extract_target(p)
            if t is None:
                if self.missing_target == "error":
                    raise RewardInputError(
                        f"prompts[{i}]: no text in double quotes in {p!r}; quote the target "
                        "text, pass `references`, or set missing_target='empty'"
                    )
                t = ""
            out.append(t)
        return out

    def read(self, image: np.ndarray) -> str:
        """Recognised text of one uint8 (H, W, 3) RGB image."""
        return self.backend.read(image)

    def read_many(self, images: list[np.ndarray]) -> list[str]:
        """Recognised texts of many images (text lines recognised in shared batches)."""
        many = getattr(self.backend, "read_many", None)
        return many(images) if many is not None else [self.backend.read(im) for im in images]

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        targets = self.targets(inp)
        visuals = inp.visual_list(self.name)
        frames, counts = [], []
        for v in visuals:
            idx = np.unique(
                np.linspace(0, len(v) - 1, min(self.video_frames, len(v))).round()
            ).astype(int)
            frames.extend(v[i] for i in idx)
            counts.append(len(idx))
        reads_all = self.read_many(frames)
        scores, texts, start = [], [], 0
        for c, target in zip(counts, targets):
            reads = reads_all[start : start + c]
            start += c
            scores.append(float(np.mean([ocr_score(r, target) for r in reads])))
            texts.append(" | ".join(reads))
        return RewardOutput(np.array(scores, np.float32), {"text": np.array(texts, dtype=object)})
