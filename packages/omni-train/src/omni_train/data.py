"""Prompt datasets and the per-step prompt order.

The prompts of step `s` are a pure function of (run seed, s): the stream of prompt slots
k = s * P + i (P prompts per step) walks epoch e = k // N through a permutation of the N
prompts seeded by (seed, e). Resuming at step s therefore needs no saved data-loader state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .recipe import DataConfig, RecipeError
from .seeds import DOMAIN_DATA, derive_seed


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts from a JSONL file (one object with a `prompt` string per line) or a .txt file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise RecipeError(f"data.file: {p} does not exist")
    if p.suffix == ".txt":
        prompts = [line.strip() for line in p.read_text().splitlines() if line.strip()]
    else:
        prompts = []
        for lineno, line in enumerate(p.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RecipeError(f"data.file {p}, line {lineno}: not valid JSON ({exc})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise RecipeError(f"data.file {p}, line {lineno}: needs a string 'prompt' field")
            prompts.append(row["prompt"])
    if not prompts:
        raise RecipeError(f"data.file {p}: no prompts")
    return prompts


@dataclass
class PromptData:
    prompts: list[str]
    per_step: int
    seed: int
    shuffle: bool = True

    @classmethod
    def from_config(cls, cfg: DataConfig, seed: int) -> PromptData:
        prompts = list(cfg.prompts) if cfg.prompts is not None else read_prompt_file(cfg.file)  # type: ignore[arg-type]
        return cls(prompts, cfg.prompts_per_step, seed, cfg.shuffle)

    def _order(self, epoch: int) -> list[int]:
        n = len(self.prompts)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(derive_seed(self.seed, epoch, 0, DOMAIN_DATA))
        return torch.randperm(n, generator=g).tolist()

    def prompts_for_step(self, step: int) -> list[str]:
        """The `per_step` distinct-slot prompts of training step `step`."""
        n = len(self.prompts)
        out = []
        for i in range(self.per_step):
            k = step * self.per_step + i
            out.append(self.prompts[self._order(k // n)[k % n]])
        return out
