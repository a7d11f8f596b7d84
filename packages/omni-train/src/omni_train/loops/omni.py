"""The omni (autoregressive) training loop, top to bottom: GSPO / GRPO on a thinker.

One step (prompt batch -> responses -> reward -> group advantages -> token update):

1. Rollout. P questions (`data.prompts_per_step`), each repeated `rollout.n` times under one
   group id; sample i of step s is generated with the seed `sample_seed(run_seed, s, i)`
   (temperature `rollout.temperature`, top-p `rollout.top_p`, at most
   `rollout.max_new_tokens` tokens). The rollout records the per-token log-probs of the
   sampled tokens. With `rollout.allowed_tokens` (constrained decoding) every token outside
   those strings' tokens (plus EOS) is masked in generation, validation and the replay alike.
2. Reward. The reward (`math`, `choice`, ...) reads the responses and the reference answers
   (`reward.extract: first_letter` shows it only the first free-standing choice letter).
3. Advantages. Group-relative, ``A_i = (r_i - mean_g) / (std_g + eps)``
   (`omni_algos.advantages.group_advantages`; GRPO: Shao et al. 2024, arXiv 2402.03300),
   clipped to +-`algorithm.adv_clip_max`.
4. Update. The token update (`omni_train.updates.token`) on the learner.
5. Weight sync, 6. record: as in the diffusion loop.

The first minibatch replays on the rollout weights, so its log-probs must equal the rollout's:
their largest difference is logged as `rollout/logprob_abs_diff_max` (~1e-6 on CPU float32).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data import PromptData
from ..errors import NonFiniteError, TrainError
from ..plots import save_sample_grid
from ..ports import Ports
from ..recipe import Recipe, RecipeError
from ..seeds import DOMAIN_VAL, derive_seed, sample_seed
from ..tasks import CHOICE_LETTERS, OmniItem, first_choice_letter, load_items
from ..updates import token_batch
from .run import RunFolder, sample_due, save_due, val_due

__all__ = ["OmniLoop", "images_of"]


def images_of(items: list[OmniItem], size: int = 32) -> np.ndarray:
    """The items' images as one uint8 (N, size, size, 3) array (blank where none)."""
    from PIL import Image

    out = np.zeros((len(items), size, size, 3), np.uint8)
    for i, it in enumerate(items):
        if it.image is not None:
            im = Image.fromarray(it.image)
            if im.size != (size, size):
                im = im.resize((size, size))
            out[i] = np.asarray(im.convert("RGB"))
    return out


class OmniLoop:
    """Trains a thinker with the ports of `trainer.backend` (see the module docstring)."""

    def __init__(self, recipe: Recipe, ports: Ports, run_dir: str | Path | None = None) -> None:
        self.recipe = recipe
        self.ports = ports
        self.learner = ports.learner
        self.run_dir = Path(run_dir) if run_dir is not None else recipe.output_dir()
        self.version = 0
        d = recipe.data
        if d.prompts is not None:
            raise RecipeError(
                "data.prompts: the omni path needs reference answers; use `data.file` (JSONL "
                "rows with prompt, answer, image) or `data.task`"
            )
        opts = dict(d.task_options)
        seed = recipe.trainer.seed
        train_items = load_items(d.task, d.file, "train", d.task_size, seed, opts, "data.file")
        if d.val_file is not None:
            self.val_items = load_items(None, d.val_file, "val", 0, 0, {}, "data.val_file")
        elif d.task is not None:
            self.val_items = load_items(d.task, None, "val", d.val_size, seed, opts, "")
        else:
            self.val_items = train_items[: d.val_size]
        self.data = PromptData(train_items, d.prompts_per_step, seed, d.shuffle)  # type: ignore[arg-type]
        self.reward = ports.make_reward()

    # ------------------------------------------------------------------ 2. reward
    def reward_texts(self, texts: list[str]) -> list[str]:
        if self.recipe.reward.extract == "first_letter":
            letters = str(self.recipe.reward.options.get("letters", CHOICE_LETTERS))
            return [first_choice_letter(t, letters) for t in texts]
        return list(texts)

    def score(self, items: list[OmniItem], texts: list[str]) -> tuple[np.ndarray, list[str]]:
        from omni_rewards import RewardError, RewardInput

        shown = self.reward_texts(texts)
        try:
            out = self.reward(
                RewardInput(
                    texts=shown,
                    prompts=[it.prompt for it in items],
                    references=[it.answer for it in items],
                )
            )
        except RewardError as exc:
            raise TrainError(f"reward failed: {exc}") from None
        return np.asarray(out.scores, dtype=np.float64), shown

    def save_bad_samples(
        self,
        items: list[OmniItem],
        texts: list[str],
        seeds: list[int],
        step: int,
        scores: np.ndarray | None,
        what: str,
    ) -> Path:
        """The step's images and a JSON of prompts/responses/rewards under nonfinite/."""
        out = self.run_dir / "nonfinite" / f"step_{step + 1:04d}"
        out.mkdir(parents=True, exist_ok=True)
        save_sample_grid(images_of(items), out / "samples.png", cols=self.recipe.rollout.n)
        rows = []
        for i, (it, text, seed) in enumerate(zip(items, texts, seeds)):
            v = None if scores is None else float(scores[i])
            rows.append(
                {
                    "index": i,
                    "prompt": it.prompt,
                    "answer": it.answer,
                    "response": text,
                    "seed": seed,
                    "reward": v if v is None or math.isfinite(v) else str(v),
                }
            )
        (out / "samples.json").write_text(json.dumps({"what": what, "samples": rows}, indent=1))
        return out

    # ------------------------------------------------------------------ validation
    def validate(self, step: int) -> dict[str, float]:
        """Decode the held-out items at `rollout.val_temperature` (0 = greedy)."""
        r = self.recipe
        items = self.val_items
        seeds = [derive_seed(r.trainer.seed, 0, i, DOMAIN_VAL) for i in range(len(items))]
        with self.learner.eval_weights():
            out = self.ports.rollout.generate(
                items, seeds, temperature=r.rollout.val_temperature, top_p=1.0
            )
        scores, shown = self.score(items, out["texts"])
        labels = [f"{s or '-'}/{it.answer} {v:.1f}" for s, it, v in zip(shown, items, scores)]
        save_sample_grid(
            images_of(items),
            self.run_dir / "samples" / f"val_step_{step:04d}.png",
            cols=8,
            labels=labels,
        )
        answered = np.array([bool(s.strip()) for s in shown])
        return {
            "val/reward_mean": float(scores.mean()),
            "val/reward_std": float(scores.std()),
            "val/answered_frac": float(answered.mean()),
        }

    # ------------------------------------------------------------------ the loop
    def train(self, resume_from: str | Path | None = None) -> list[dict[str, Any]]:
        r = self.recipe
        self.run = RunFolder(r, self.run_dir, fresh=resume_from is None)
        start = 0
        if resume_from is not None:
            start, self.version, _ = self.run.restore(resume_from, self.learner)
            self.ports.rollout.update_weights(self.learner.rollout_weights(), self.version)
        rows: list[dict[str, Any]] = []
        self.run.start(start)
        if r.trainer.val_every and start == 0:  # the baseline: the model before any update
            self.run.log_baseline(self.validate(0))
        try:
            for step in range(start, r.trainer.steps):
                rows.append(self.train_step(step))
        finally:
            t = r.rollout.val_temperature
            self.run.finish("val reward (greedy)" if t == 0 else f"val reward (T={t:g})")
        return rows

    def train_step(self, step: int) -> dict[str, Any]:
        from omni_algos.advantages import group_advantages

        r = self.recipe
        a = r.algorithm
        t0 = time.perf_counter()
        items, group_ids, seeds = [], [], []  # 1
        for g, item in enumerate(self.data.prompts_for_step(step)):
            for _ in range(r.rollout.n):
                seeds.append(sample_seed(r.trainer.seed, step, len(items)))
                items.append(item)
                group_ids.append(g)
        out = self.ports.rollout.generate(
            items, seeds, temperature=r.rollout.temperature, top_p=r.rollout.top_p
        )
        t1 = time.perf_counter()
        rewards, shown = self.score(items, out["texts"])  # 2
        bad = ~np.isfinite(rewards)
        if bad.any():
            path = self.save_bad_samples(items, out["texts"], seeds, step, rewards, "reward")
            raise NonFiniteError(
                f"step {step + 1}: reward is NaN/inf for {int(bad.sum())} of {len(rewards)} samples "
                f"(indices {np.flatnonzero(bad)[:8].tolist()}); samples saved to {path}"
            )
        t2 = time.perf_counter()
        adv = group_advantages(  # 3
            torch.as_tensor(rewards, dtype=torch.float32), torch.as_tensor(group_ids), std=a.adv_std
        ).clamp(-a.adv_clip_max, a.adv_clip_max)
        batch = token_batch(
            items, out["tokens"], out["log_probs"], out["mask"], adv, out["temperature"]
        )
        try:
            metrics = self.learner.update(batch, step)  # 4
        except NonFiniteError as exc:
            path = self.save_bad_samples(items, out["texts"], seeds, step, rewards, "loss")
            raise NonFiniteError(f"step {step + 1}: {exc}; samples saved to {path}") from None
        self.version = step + 1
        self.ports.rollout.update_weights(self.learner.rollout_weights(), self.version)  # 5
        t3 = time.perf_counter()
        lengths = out["mask"].sum(-1).float()  # 6
        row: dict[str, Any] = {
            "step": step + 1,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/min": float(rewards.min()),
            "reward/max": float(rewards.max()),
            "reward/answered_frac": float(np.mean([bool(s.strip()) for s in shown])),
        }
        row["reward/frac_zero_std"] = float(
            (rewards.reshape(-1, r.rollout.n).std(axis=1) < 1e-8).mean()
        )
        row.update(metrics)
        row["actor/adv_abs_mean"] = float(adv.abs().mean())
        row["rollout/rows"] = len(items)
        row["rollout/forwards"] = out["forwards"]
        row["rollout/response_len_mean"] = float(lengths.mean())
        row["rollout/response_len_max"] = int(lengths.max())
        row["rollout/version"] = step
        row["weights/version"] = self.version
        if sample_due(self.recipe, step):
            n = r.rollout.n
            firsts = list(range(0, len(items), n))
            labels = [
                f"{items[i].answer}: {' '.join((s or '-') for s in shown[i : i + n])}"
                for i in firsts
            ]
            path = save_sample_grid(
                images_of([items[i] for i in firsts]),
                self.run_dir / "samples" / f"step_{step + 1:04d}.png",
                cols=len(firsts),
                labels=[lab[:40] for lab in labels],
            )
            path.with_suffix(".json").write_text(
                json.dumps(
                    [
                        {
                            "prompt": it.prompt,
                            "answer": it.answer,
                            "response": tx,
                            "reward": float(v),
                        }
                        for it, tx, v in zip(items, out["texts"], rewards)
                    ],
                    indent=1,
                )
            )
            self.run.logger.log_image("samples", path, step + 1)
        t4 = time.perf_counter()
        if val_due(self.recipe, step):
            row.update(self.validate(step + 1))
        t5 = time.perf_counter()
        if save_due(self.recipe, step):
            self.run.save(step + 1, self.learner, self.version, diffusers_lora=False, row=row)
        t6 = time.perf_counter()
        n_tok = int(out["mask"].sum())
        row["timing/rollout_s"] = t1 - t0
        row["timing/reward_s"] = t2 - t1
        row["timing/update_s"] = t3 - t2
        row["timing/val_s"] = t5 - t4
        row["timing/save_s"] = t6 - t5
        row["timing/step_s"] = t6 - t0
        row["perf/samples_per_s"] = len(items) / max(t1 - t0, 1e-9)
        row["perf/tokens_per_s"] = n_tok / max(t1 - t0, 1e-9)
        self.run.log(row)
        return row
