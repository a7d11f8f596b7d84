"""The omni (autoregressive) training loop: GSPO / GRPO on a thinker adapter, one process.

One step (prompt batch -> responses -> reward -> group advantages -> token-loss update):

1. P questions (`data.prompts_per_step`), each repeated `rollout.n` times under one group id;
   sample i of step s is generated with the seed `sample_seed(run_seed, s, i)` by
   `ThinkerAdapter.generate` (temperature `rollout.temperature`, top-p `rollout.top_p`,
   at most `rollout.max_new_tokens` tokens), in chunks of `rollout.max_num_seqs` rows. The
   rollout records the per-token log-probs `lp_old` of the sampled tokens. With
   `rollout.allowed_tokens` (constrained decoding) every token outside those strings' tokens
   (plus EOS) is masked to -inf in generation, validation and the replay of step 4 alike, so
   the trained policy is the masked, renormalised distribution.
2. The reward (`math`, `choice`, ...) reads the responses and the reference answers
   (`reward.extract: first_letter` shows it only the first free-standing choice letter).
3. Advantages are group-relative, ``A_i = (r_i - mean_g) / (std_g + eps)``
   (`omni_algos.advantages.group_advantages`, GRPO: Shao et al. 2024, arXiv 2402.03300),
   clipped to +-`algorithm.adv_clip_max`.
4. `ThinkerAdapter.token_log_probs` replays the responses with grad and the token loss
   `LOSSES[algorithm.name]` (GSPO: Zheng et al. 2025, arXiv 2507.18071, sequence ratio
   ``s_i = exp(mean_t(lp_t - lp_old_t))``; or token-level GRPO) gives the gradient, summed
   over micro-batches of `rollout.max_num_seqs` rows, `algorithm.num_minibatches` AdamW steps
   per rollout batch for `algorithm.epochs` passes, global grad-norm clip. With
   `algorithm.kl_beta > 0` the k3 estimator of KL to the base model (LoRA disabled),
   ``KL_t = exp(lp_ref - lp) - (lp_ref - lp) - 1`` (Schulman 2020), is added per token.

The first minibatch replays on the rollout weights, so its log-probs must equal the rollout's:
their largest difference is logged as `rollout/logprob_abs_diff_max` (~1e-6 on CPU float32).
Outputs match `LocalTrainer`: `metrics.jsonl`, `reward_curve.png`, sample grids, checkpoints.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .data import PromptData
from .errors import NonFiniteError, TrainError
from .logger import MetricsLogger, console_line, open_logger
from .plots import plot_reward_curve, read_metrics, save_sample_grid
from .recipe import OMNI_LOSSES, Recipe, RecipeError, dump_recipe, load_recipe
from .seeds import DOMAIN_MINIBATCH, DOMAIN_VAL, derive_seed, sample_seed
from .tasks import CHOICE_LETTERS, OmniItem, first_choice_letter, load_items
from .trainer import build_reward, clear_run_dir, ensure_model, quiet_libraries

__all__ = ["OmniBatch", "OmniTrainer", "k3_kl", "omni_resume", "omni_train"]


def k3_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked token mean of the k3 KL estimator ``exp(d) - d - 1``, ``d = lp_ref - lp``
    (unbiased for KL(pi || pi_ref) under samples of pi, always >= 0; Schulman 2020,
    "Approximating KL divergence")."""
    d = (ref_log_prob.detach() - log_prob).clamp(-20.0, 20.0)
    m = mask.to(log_prob.dtype)
    return ((torch.exp(d) - d - 1.0) * m).sum() / m.sum().clamp(min=1.0)


def _images_of(items: list[OmniItem], size: int = 32) -> np.ndarray:
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


@dataclass
class OmniBatch:
    """One step's rollout: the items (each repeated n times) and what generation returned."""

    items: list[OmniItem]
    group_ids: list[int]
    seeds: list[int]
    tokens: torch.Tensor  # (B, T) int64
    log_probs: torch.Tensor  # (B, T) float32
    mask: torch.Tensor  # (B, T) bool
    texts: list[str]
    temperature: float
    rewards: np.ndarray | None = None
    answers: list[str] | None = None


class OmniTrainer:
    """GSPO / GRPO training of a `ThinkerAdapter` (e.g. the Qwen3-Omni thinker) in one process."""

    def __init__(self, recipe: Recipe, run_dir: str | Path | None = None) -> None:
        self.recipe = recipe
        self.run_dir = Path(run_dir) if run_dir is not None else recipe.output_dir()
        self.step = 0
        self.version = 0
        self._setup_done = False

    # -------------------------------------------------------------- setup
    def setup(self) -> None:
        from omni_adapters import from_pretrained
        from omni_adapters.thinker import ThinkerAdapter
        from omni_algos.losses import LOSSES

        r = self.recipe
        if r.trainer.threads:
            torch.set_num_threads(r.trainer.threads)
        quiet_libraries()
        if r.algorithm.name not in OMNI_LOSSES or r.algorithm.name not in LOSSES:
            raise RecipeError(
                f"algorithm.name: the omni path needs a token loss ({', '.join(OMNI_LOSSES)}), "
                f"got {r.algorithm.name!r}"
            )
        self.loss_fn = LOSSES[r.algorithm.name]
        path = ensure_model(r)
        try:
            self.adapter = from_pretrained(
                path, dtype=r.model.dtype, device=r.model.device, **r.model.options
            )
        except (ValueError, FileNotFoundError) as exc:
            raise TrainError(f"model.path: cannot load {path}: {exc}") from None
        if not isinstance(self.adapter, ThinkerAdapter):
            raise TrainError(
                f"model.path: {path} is a {type(self.adapter).__name__}, not an autoregressive "
                f"(thinker) model; gspo/grpo train omni models such as Qwen3-Omni"
            )
        if r.lora.enabled:
            torch.manual_seed(r.lora.init_seed)
            try:
                self.adapter.add_lora(
                    r.lora.rank,
                    r.lora.alpha,
                    target_modules=r.lora.target_modules,
                    dropout=r.lora.dropout,
                )
            except ValueError as exc:
                raise TrainError(f"lora: {exc}") from None
        else:
            if r.algorithm.kl_beta > 0:
                raise TrainError(
                    "algorithm.kl_beta > 0 needs lora.enabled: the KL reference is the base "
                    "model with the LoRA adapters disabled"
                )
            self.adapter.set_trainable("full")
        self.allowed_ids: list[int] | None = None
        if r.rollout.allowed_tokens:
            try:
                self.allowed_ids = self.adapter.allowed_token_ids(r.rollout.allowed_tokens)
            except ValueError as exc:
                msg = str(exc).removeprefix("allowed_tokens: ")
                raise RecipeError(f"rollout.allowed_tokens: {msg}") from None
        self.ema = r.optimizer.ema_decay > 0
        if self.ema:
            if not r.lora.enabled:
                raise TrainError("optimizer.ema_decay > 0 needs lora.enabled (EMA of the LoRA)")
            self.adapter.add_adapter_copy("default", "ema")
        self.params_named = self.adapter.named_trainable_parameters()
        if not self.params_named:
            raise TrainError("nothing to train: the model has no trainable parameters")
        o = r.optimizer
        self.optimizer = torch.optim.AdamW(
            list(self.params_named.values()),
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
        self.reward = build_reward(r)
        d = r.data
        if d.prompts is not None:
            raise RecipeError(
                "data.prompts: the omni path needs reference answers; use `data.file` (JSONL "
                "rows with prompt, answer, image) or `data.task`"
            )
        opts = dict(d.task_options)
        train_items = load_items(
            d.task, d.file, "train", d.task_size, r.trainer.seed, opts, "data.file"
        )
        if d.val_file is not None:
            self.val_items = load_items(None, d.val_file, "val", 0, 0, {}, "data.val_file")
        elif d.task is not None:
            self.val_items = load_items(d.task, None, "val", d.val_size, r.trainer.seed, opts, "")
        else:
            self.val_items = train_items[: d.val_size]
        self.data = PromptData(train_items, d.prompts_per_step, r.trainer.seed, d.shuffle)  # type: ignore[arg-type]
        self._setup_done = True

    # -------------------------------------------------------------- generation
    def _build(self, items: list[OmniItem]) -> dict[str, Any]:
        images = [it.image for it in items if it.image is not None]
        return self.adapter.build_batch([it.content() for it in items], images=images or None)

    def _generate(
        self, items: list[OmniItem], seeds: list[int], temperature: float, top_p: float
    ) -> dict[str, Any]:
        """Generate in chunks of `rollout.max_num_seqs`, padded to `rollout.max_new_tokens`."""
        r = self.recipe.rollout
        t_max = r.max_new_tokens
        toks, lps, masks, texts = [], [], [], []
        self._forwards = 0
        temp_out = 1.0
        for s in range(0, len(items), r.max_num_seqs):
            chunk = items[s : s + r.max_num_seqs]
            out = self.adapter.generate(
                self._build(chunk),
                max_new_tokens=t_max,
                temperature=temperature,
                top_p=top_p,
                seed=seeds[s : s + len(chunk)],
                allowed_tokens=self.allowed_ids,
            )
            temp_out = float(out.get("temperature", temperature or 1.0))
            t = out["tokens"].shape[1]
            pad = t_max - t
            toks.append(torch.nn.functional.pad(out["tokens"], (0, pad)))
            lps.append(torch.nn.functional.pad(out["log_probs"].float(), (0, pad)))
            masks.append(torch.nn.functional.pad(out["mask"].bool(), (0, pad)))
            texts.extend(out["texts"])
            self._forwards += t
        return {
            "tokens": torch.cat(toks),
            "log_probs": torch.cat(lps),
            "mask": torch.cat(masks),
            "texts": texts,
            "temperature": temp_out,
        }

    def rollout(self, step: int) -> OmniBatch:
        r = self.recipe
        items, group_ids, seeds = [], [], []
        for g, item in enumerate(self.data.prompts_for_step(step)):
            for _ in range(r.rollout.n):
                seeds.append(sample_seed(r.trainer.seed, step, len(items)))
                items.append(item)
                group_ids.append(g)
        with torch.no_grad():
            out = self._generate(items, seeds, r.rollout.temperature, r.rollout.top_p)
        return OmniBatch(
            items,
            group_ids,
            seeds,
            out["tokens"],
            out["log_probs"],
            out["mask"],
            out["texts"],
            out["temperature"],
        )

    # -------------------------------------------------------------- reward
    def _reward_texts(self, texts: list[str]) -> list[str]:
        if self.recipe.reward.extract == "first_letter":
            letters = str(self.recipe.reward.options.get("letters", CHOICE_LETTERS))
            return [first_choice_letter(t, letters) for t in texts]
        return list(texts)

    def _score(self, items: list[OmniItem], texts: list[str]) -> tuple[np.ndarray, list[str]]:
        from omni_rewards import RewardError, RewardInput

        shown = self._reward_texts(texts)
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

    def score(self, batch: OmniBatch, step: int) -> None:
        scores, shown = self._score(batch.items, batch.texts)
        bad = ~np.isfinite(scores)
        if bad.any():
            path = self.save_bad_samples(batch, step, scores, "reward")
            raise NonFiniteError(
                f"step {step}: reward is NaN/inf for {int(bad.sum())} of {len(scores)} samples "
                f"(indices {np.flatnonzero(bad)[:8].tolist()}); samples saved to {path}"
            )
        batch.rewards = scores
        batch.answers = shown

    def save_bad_samples(
        self, batch: OmniBatch, step: int, scores: np.ndarray | None, what: str
    ) -> Path:
        """Write the step's images and a JSON of prompts/responses/rewards to nonfinite/."""
        out = self.run_dir / "nonfinite" / f"step_{step:04d}"
        out.mkdir(parents=True, exist_ok=True)
        save_sample_grid(_images_of(batch.items), out / "samples.png", cols=self.recipe.rollout.n)
        rows = []
        for i, (it, text, seed) in enumerate(zip(batch.items, batch.texts, batch.seeds)):
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

    # -------------------------------------------------------------- update
    def update(self, batch: OmniBatch, step: int) -> dict[str, float]:
        from omni_algos.advantages import group_advantages

        r = self.recipe
        a = r.algorithm
        rewards = torch.as_tensor(batch.rewards, dtype=torch.float32)
        adv = group_advantages(rewards, torch.as_tensor(batch.group_ids), std=a.adv_std)
        adv = adv.clamp(-a.adv_clip_max, a.adv_clip_max)
        b = len(batch.items)
        mb = b // a.num_minibatches
        micro = r.rollout.max_num_seqs
        params = list(self.params_named.values())
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}

        def acc(key: str, value: float) -> None:
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1

        diffs: list[torch.Tensor] = []
        for epoch in range(a.epochs):
            g = torch.Generator().manual_seed(
                derive_seed(r.trainer.seed, step, epoch, DOMAIN_MINIBATCH)
            )
            perm = torch.randperm(b, generator=g) if a.num_minibatches > 1 else torch.arange(b)
            for k in range(a.num_minibatches):
                idx_mb = perm[k * mb : (k + 1) * mb]
                self.optimizer.zero_grad(set_to_none=True)
                loss_total = 0.0
                for s in range(0, len(idx_mb), micro):
                    idx = idx_mb[s : s + micro]
                    frac = len(idx) / len(idx_mb)
                    mask = batch.mask[idx]
                    t = max(int(mask.sum(-1).max()), 1)
                    prompt = self._build([batch.items[int(i)] for i in idx])
                    rb = {
                        **prompt,
                        "responses": batch.tokens[idx, :t],
                        "response_mask": mask[:, :t],
                        "temperature": batch.temperature,
                        "allowed_tokens": self.allowed_ids,
                    }
                    lp = self.adapter.token_log_probs(rb)
                    old = batch.log_probs[idx, :t]
                    m = mask[:, :t]
                    if epoch == 0 and k == 0:  # minibatch 0 runs on the rollout weights
                        diffs.append((lp.detach() - old).abs()[m])
                    lo = self.loss_fn(
                        log_prob=lp, old_log_prob=old, advantages=adv[idx], mask=m, **a.options
                    )
                    loss = lo.loss
                    if a.kl_beta > 0:
                        with torch.no_grad(), self.adapter.disabled_adapters():
                            ref = self.adapter.token_log_probs(rb)
                        kl = k3_kl(lp, ref, m)
                        loss = loss + a.kl_beta * kl
                        acc("actor/kl_ref", float(kl.detach()))
                    if not torch.isfinite(loss):
                        path = self.save_bad_samples(batch, step, batch.rewards, "loss")
                        raise NonFiniteError(
                            f"step {step}: loss is {float(loss)} (minibatch {k}); samples saved "
                            f"to {path}"
                        )
                    (loss * frac).backward()
                    loss_total += float(loss.detach()) * frac
                    for name, val in lo.metrics.items():
                        acc(f"actor/{name}", val)
                gn = torch.nn.utils.clip_grad_norm_(params, r.optimizer.grad_clip)
                if not torch.isfinite(gn):
                    path = self.save_bad_samples(batch, step, batch.rewards, "grad")
                    raise NonFiniteError(
                        f"step {step}: gradient norm is {float(gn)}; samples saved to {path}"
                    )
                self.optimizer.step()
                if self.ema:
                    self.adapter.ema_adapter("default", "ema", r.optimizer.ema_decay)
                acc("loss", loss_total)
                acc("actor/grad_norm", float(gn))
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {k: sums[k] / counts[k] for k in sums}
        # one name for the ratio and the KL across gspo (sequence ratio) and grpo (token ratio)
        if "actor/seq_ratio_mean" in metrics:
            metrics["actor/ratio_mean"] = metrics["actor/seq_ratio_mean"]
        if "actor/ppo_kl" in metrics:
            metrics["actor/approx_kl"] = metrics["actor/ppo_kl"]
        if diffs:
            d = torch.cat(diffs)
            metrics["rollout/logprob_abs_diff_max"] = float(d.max()) if d.numel() else 0.0
            metrics["rollout/logprob_abs_diff_mean"] = float(d.mean()) if d.numel() else 0.0
        metrics["actor/adv_abs_mean"] = float(adv.abs().mean())
        return metrics

    def sync_weights(self, version: int) -> None:
        """Generation runs on the trained module itself, so syncing is a version bump."""
        self.version = version

    # -------------------------------------------------------------- validation
    def validate(self, step: int) -> dict[str, float]:
        """Decode the fixed held-out items at `rollout.val_temperature` (0 = greedy)."""
        r = self.recipe
        items = self.val_items
        seeds = [derive_seed(r.trainer.seed, 0, i, DOMAIN_VAL) for i in range(len(items))]
        with torch.no_grad():
            if self.ema:
                with self.adapter.use_adapter("ema"):
                    out = self._generate(items, seeds, r.rollout.val_temperature, 1.0)
            else:
                out = self._generate(items, seeds, r.rollout.val_temperature, 1.0)
        scores, shown = self._score(items, out["texts"])
        labels = [f"{s or '-'}/{it.answer} {v:.1f}" for s, it, v in zip(shown, items, scores)]
        save_sample_grid(
            _images_of(items),
            self.run_dir / "samples" / f"val_step_{step:04d}.png",
            cols=8,
            labels=labels,
        )
        self._val_texts = out["texts"]
        answered = np.array([bool(s.strip()) for s in shown])
        return {
            "val/reward_mean": float(scores.mean()),
            "val/reward_std": float(scores.std()),
            "val/answered_frac": float(answered.mean()),
        }

    # -------------------------------------------------------------- checkpoints
    def _trainable_state(self) -> dict[str, torch.Tensor]:
        out = {k: p.detach() for k, p in self.params_named.items()}
        if self.ema:
            out.update(
                {f"ema/{k}": v.detach() for k, v in self.adapter.adapter_state("ema").items()}
            )
        return out

    def save(self, step: int) -> Path:
        lora_tensors = lora_cfg = None
        if self.recipe.lora.enabled:
            lora_tensors = self.adapter.export_rollout_weights(fmt="peft")
            lora_cfg = self.adapter.lora_config()
        return save_checkpoint(
            self.run_dir / "checkpoint",
            step,
            self._trainable_state(),
            self.optimizer,
            state={"version": self.version, "experiment": self.recipe.experiment},
            lora_tensors=lora_tensors,
            lora_config=lora_cfg,
            keep=self.recipe.trainer.keep_checkpoints,
        )

    def restore(self, path: str | Path) -> int:
        ck = load_checkpoint(path)
        ema = {k.removeprefix("ema/"): v for k, v in ck.trainable.items() if k.startswith("ema/")}
        ck.trainable = {k: v for k, v in ck.trainable.items() if not k.startswith("ema/")}
        missing = sorted(set(self.params_named) - set(ck.trainable))
        unknown = sorted(set(ck.trainable) - set(self.params_named))
        if missing or unknown:
            raise TrainError(
                f"checkpoint {ck.path} does not match the model: missing {missing[:3]}, "
                f"unexpected {unknown[:3]} (was the recipe's model or lora changed?)"
            )
        with torch.no_grad():
            for k, p in self.params_named.items():
                p.copy_(ck.trainable[k].to(p.device, p.dtype))
            if self.ema:
                if not ema:
                    raise TrainError(f"checkpoint {ck.path} has no EMA weights")
                for k, t in self.adapter.adapter_state("ema").items():
                    t.copy_(ema[k].to(t.device, t.dtype))
        if ck.optimizer is not None:
            self.optimizer.load_state_dict(ck.optimizer)
        ck.restore_rng()
        self.step = ck.step
        self.sync_weights(int(ck.state.get("version", ck.step)))
        return ck.step

    # -------------------------------------------------------------- the loop
    def train(self, resume_from: str | Path | None = None) -> list[dict[str, Any]]:
        from tqdm.auto import tqdm

        r = self.recipe
        if not self._setup_done:
            self.setup()
        if resume_from is None:
            clear_run_dir(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "recipe.yaml").write_text(dump_recipe(r))
        logger = open_logger(r, self.run_dir)
        start = self.restore(resume_from) if resume_from is not None else 0
        logger.truncate_after(start - 1)
        rows: list[dict[str, Any]] = []
        total = r.trainer.steps
        bar = tqdm(
            total=total,
            initial=start,
            desc=r.experiment,
            disable=not r.trainer.progress,
            dynamic_ncols=True,
        )
        try:
            for step in range(start, total):
                row = self.train_step(step, logger)
                rows.append(row)
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward/mean']:.4f}")
                if (step + 1) % r.trainer.log_every == 0 or step + 1 == total:
                    msg = console_line(row, total)
                    if r.trainer.progress:
                        bar.write(msg)
                    else:
                        print(msg, flush=True)
        finally:
            bar.close()
            all_rows = read_metrics(logger.path)
            if all_rows:
                plot_reward_curve(
                    all_rows,
                    self.run_dir / "reward_curve.png",
                    title=r.experiment,
                    val_label="val reward (greedy)"
                    if r.rollout.val_temperature == 0
                    else f"val reward (T={r.rollout.val_temperature:g})",
                )
            logger.close()
        return rows

    def train_step(self, step: int, logger: MetricsLogger) -> dict[str, Any]:
        r = self.recipe
        t0 = time.perf_counter()
        batch = self.rollout(step)
        t1 = time.perf_counter()
        self.score(batch, step)
        t2 = time.perf_counter()
        metrics = self.update(batch, step)
        self.sync_weights(step + 1)
        t3 = time.perf_counter()
        rw = batch.rewards
        assert rw is not None and batch.answers is not None
        lengths = batch.mask.sum(-1).float()
        row: dict[str, Any] = {
            "step": step,
            "reward/mean": float(rw.mean()),
            "reward/std": float(rw.std()),
            "reward/min": float(rw.min()),
            "reward/max": float(rw.max()),
            "reward/answered_frac": float(np.mean([bool(s.strip()) for s in batch.answers])),
        }
        row.update(metrics)
        row["rollout/rows"] = len(batch.items)
        row["rollout/forwards"] = self._forwards
        row["rollout/response_len_mean"] = float(lengths.mean())
        row["rollout/response_len_max"] = int(lengths.max())
        row["rollout/version"] = step
        row["weights/version"] = self.version
        self.step = step + 1
        if r.trainer.sample_every and (
            step % r.trainer.sample_every == 0 or step + 1 == r.trainer.steps
        ):
            n = r.rollout.n
            firsts = list(range(0, len(batch.items), n))
            labels = [
                f"{batch.items[i].answer}: {' '.join((s or '-') for s in batch.answers[i : i + n])}"
                for i in firsts
            ]
            path = save_sample_grid(
                _images_of([batch.items[i] for i in firsts]),
                self.run_dir / "samples" / f"step_{step:04d}.png",
                cols=len(firsts),
                labels=[lab[:40] for lab in labels],
            )
            (path.with_suffix(".json")).write_text(
                json.dumps(
                    [
                        {
                            "prompt": it.prompt,
                            "answer": it.answer,
                            "response": t,
                            "reward": float(v),
                        }
                        for it, t, v in zip(batch.items, batch.texts, rw)
                    ],
                    indent=1,
                )
            )
            if logger.tb is not None:
                from PIL import Image

                logger.log_image("samples", np.asarray(Image.open(path)), step)
        t4 = time.perf_counter()
        if r.trainer.val_every and (
            (step + 1) % r.trainer.val_every == 0 or step + 1 == r.trainer.steps
        ):
            row.update(self.validate(step))
        t5 = time.perf_counter()
        if (r.trainer.save_every and (step + 1) % r.trainer.save_every == 0) or (
            step + 1 == r.trainer.steps
        ):
            self.save(step + 1)
        t6 = time.perf_counter()
        n_tok = int(batch.mask.sum())
        row["timing/rollout_s"] = t1 - t0
        row["timing/reward_s"] = t2 - t1
        row["timing/update_s"] = t3 - t2
        row["timing/val_s"] = t5 - t4
        row["timing/save_s"] = t6 - t5
        row["timing/step_s"] = t6 - t0
        row["perf/samples_per_s"] = len(batch.items) / max(t1 - t0, 1e-9)
        row["perf/tokens_per_s"] = n_tok / max(t1 - t0, 1e-9)
        logger.log(row)
        return row


# ---------------------------------------------------------------------------------------------
# entry points


def omni_train(recipe: Recipe, run_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Run an omni recipe from step 0; returns the per-step metric rows."""
    return OmniTrainer(recipe, run_dir).train()


def omni_resume(run: str | Path, overrides: list[str] | None = None) -> list[dict[str, Any]]:
    """Continue an omni run from its latest checkpoint (its saved recipe plus `overrides`)."""
    run = Path(run)
    ck = latest_checkpoint(run / "checkpoint")
    if ck is None:
        raise TrainError(f"resume: {run} has no complete checkpoint under {run / 'checkpoint'}")
    recipe = load_recipe(run / "recipe.yaml", [*list(overrides or []), f"trainer.output_dir={run}"])
    return OmniTrainer(recipe, run).train(resume_from=ck)
