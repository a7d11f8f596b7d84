"""The local training loop (one process): rollout -> reward -> advantages -> update -> sync.

One step of FlowGRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online
RL", arXiv 2505.05470):

1. P prompts (`data.prompts_per_step`), each repeated `rollout.n` times with one group id per
   prompt; sample i of step s gets the seed `sample_seed(run_seed, s, i)`.
2. One `RolloutRequest` per sample to the `EmbeddedEngine`; each `Trajectory` holds the latents
   x_k..x_{k+W} of its SDE window, their log-probs and sigmas.
3. The reward scores the decoded images; advantages are group-relative
   (`omni_algos.advantages.group_advantages`), clipped to +-`algorithm.adv_clip_max`.
4. For each window step j the adapter recomputes v_theta(x_j, sigma_j) with grad,
   `omni_algos.sde.step(x_j, v, sigma_j, sigma_next_j, prev_sample=x_{j+1})` gives the new
   log-prob, and the loss (`omni_algos.losses.LOSSES[algorithm.name]`) its gradient, averaged
   over the W window steps. AdamW on the LoRA parameters, global grad-norm clip.
5. The LoRA tensors go to the engine with `update_weights(tensors, version=step + 1)`.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .data import PromptData
from .errors import NonFiniteError, TrainError
from .forward_process import forward_process_update
from .latent_scorer import ensure_latent_scorer
from .logger import MetricsLogger, console_line, open_logger
from .plots import (
    plot_reward_curve,
    read_metrics,
    save_frame_strip,
    save_sample_grid,
    save_waveform_plot,
)
from .recipe import (
    FORWARD_PROCESS_LOSSES,
    Recipe,
    RecipeError,
    dump_recipe,
    load_recipe,
    unknown_name,
)
from .seeds import DOMAIN_MINIBATCH, DOMAIN_VAL, derive_seed, sample_seed

#: metrics that measure wall-clock time (they differ between runs; everything else must not)
TIMING_PREFIXES = ("timing/", "perf/")


# ---------------------------------------------------------------------------------------------
# building the pieces


def _is_saved_model(path: Path) -> bool:
    """A diffusers pipeline folder or a transformers model folder."""
    return (path / "model_index.json").is_file() or (path / "config.json").is_file()


def ensure_model(recipe: Recipe) -> Path:
    """The model folder; builds the tiny model there first when `model.tiny` is set.

    A tiny model cached by an older build (its `tiny_build.json` names another family, seed
    or builder revision) is rebuilt in place; a folder without that stamp is used as is."""
    m = recipe.model
    path = Path(m.path)
    has_config = _is_saved_model(path)
    if has_config and m.tiny is not None:
        from omni_adapters import tiny

        stamp_file = path / tiny.STAMP_FILE
        try:
            wanted = tiny.build_stamp(m.tiny, m.tiny_seed)
        except ValueError as exc:
            raise TrainError(f"model.tiny: {exc}") from None
        if stamp_file.is_file() and json.loads(stamp_file.read_text()) != wanted:
            stale = path.with_name(f".{path.name}.stale-{os.getpid()}")
            try:
                path.rename(stale)  # another run may have swapped it first: then keep theirs
            except OSError:
                pass
            else:
                shutil.rmtree(stale, ignore_errors=True)
            has_config = _is_saved_model(path)
    if has_config:
        return path
    if m.tiny is None:
        if path.exists():
            raise TrainError(
                f"model.path: {path} has no model_index.json or config.json (not a saved model)"
            )
        raise TrainError(
            f"model.path: {path} does not exist. Point it at a downloaded model folder, or set "
            f"`model.tiny: <family>` (e.g. sd3) to build a tiny random model there."
        )
    from omni_adapters import tiny

    if path.exists() and any(path.iterdir()):
        raise TrainError(f"model.path: {path} exists but holds no model; empty it or pick another")
    tmp = path.with_name(f".{path.name}.building-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tiny.build(m.tiny, tmp, seed=m.tiny_seed)
    except ValueError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TrainError(f"model.tiny: {exc}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.exists():
            path.rmdir()  # the empty folder checked above
        tmp.rename(path)
    except OSError:  # another run built it meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_saved_model(path):
            raise TrainError(f"model.path: could not move the tiny model into {path}") from None
    return path


def quiet_libraries() -> None:
    """Silence the model libraries' loading bars and info logs (the trainer has its own)."""
    import logging
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in ("transformers", "diffusers"):
        try:
            mod = __import__(f"{name}.utils.logging", fromlist=["logging"])
            mod.set_verbosity_error()
            mod.disable_progress_bar()
        except (ImportError, AttributeError):
            pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*should be kept in float32.*")


#: files and folders a run writes; a fresh run in an existing folder removes these first
RUN_OUTPUTS = (
    "metrics.jsonl",
    "reward_curve.png",
    "recipe.yaml",
    "samples",
    "checkpoint",
    "tensorboard",
    "nonfinite",
)


def clear_run_dir(run_dir: Path) -> None:
    """Remove a previous run's outputs (only the names in `RUN_OUTPUTS`)."""
    for name in RUN_OUTPUTS:
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def set_full_trainable(adapter: Any, recipe: Recipe) -> None:
    """Full fine-tuning: every parameter of the trainable component, or with
    `lora.full_regex` only those whose full name matches it."""
    modules: list[str] = []
    if recipe.lora.full_regex is not None:
        pattern = re.compile(recipe.lora.full_regex)
        names = [n for n, _ in adapter.model.named_parameters()]
        modules = [n for n in names if pattern.fullmatch(n)]
        if not modules:
            raise TrainError(
                f"lora.full_regex: {recipe.lora.full_regex!r} matches no parameter of the "
                f"model (e.g. {names[0]!r})"
            )
    adapter.set_trainable("full", modules=modules)


def build_reward(recipe: Recipe) -> Any:
    """`load_reward` (one name) or a `MultiReward` (several `terms`), with clear errors."""
    import omni_rewards

    def one(name: str, options: dict[str, Any], key: str) -> Any:
        try:
            return omni_rewards.load_reward(name, **options)
        except omni_rewards.MissingDependencyError as exc:
            raise TrainError(f"{key}: {exc}") from None
        except KeyError as exc:
            raise TrainError(f"{key}: {exc.args[0] if exc.args else exc}") from None
        except TypeError as exc:
            bad = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
            if bad:
                opts = key.removesuffix(".name") + ".options"
                raise TrainError(
                    f"{opts}: reward {name!r} has no option {bad.group(1)!r}"
                ) from None
            raise TrainError(f"{key} / options: {exc}") from None
        except (ValueError, FileNotFoundError) as exc:
            raise TrainError(f"{key} / options: {exc}") from None

    r = recipe.reward
    if r.name is not None:
        return one(r.name, dict(r.options), "reward.name")
    terms: dict[str, tuple[Any, float]] = {}
    for i, t in enumerate(r.terms or []):
        key = t.name if t.name not in terms else f"{t.name}_{i}"
        terms[key] = (one(t.name, dict(t.options), f"reward.terms[{i}].name"), t.weight)
    return omni_rewards.MultiReward(terms)


def _loss_fn(recipe: Recipe):
    from omni_algos.losses import LOSSES

    name = recipe.algorithm.name
    if name not in LOSSES:
        raise RecipeError(unknown_name("algorithm.name", "loss", name, LOSSES))
    return LOSSES[name]


def _call_loss(fn, **kwargs: Any):
    """Call a loss with the keyword arguments it accepts (losses differ in their knobs)."""
    sig = inspect.signature(fn)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in sig.parameters})


def media_fields(media: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 media as `RewardInput` fields: (B, H, W, 3) images or (B, F, H, W, 3) videos."""
    return {"videos": media} if media.ndim == 5 else {"images": media}


def still_frames(media: np.ndarray) -> np.ndarray:
    """One picture per sample for the grids: the image, or a video's middle frame."""
    return media[:, media.shape[1] // 2] if media.ndim == 5 else media


def _stack(trajs: list[Any], attr: str) -> torch.Tensor:
    return torch.stack([getattr(t, attr) for t in trajs])


# ---------------------------------------------------------------------------------------------
# the trainer


@dataclass
class StepBatch:
    prompts: list[str]
    group_ids: list[int]
    seeds: list[int]
    trajectories: list[Any]
    images: np.ndarray | None = None
    rewards: np.ndarray | None = None
    reward_details: dict[str, np.ndarray] = field(default_factory=dict)


class LocalTrainer:
    """FlowGRPO-family training in one process with an embedded rollout engine."""

    def __init__(self, recipe: Recipe, run_dir: str | Path | None = None) -> None:
        self.recipe = recipe
        self.run_dir = Path(run_dir) if run_dir is not None else recipe.output_dir()
        self.step = 0  # completed steps
        self.version = 0
        self._setup_done = False

    # -------------------------------------------------------------- setup
    def setup(self) -> None:
        from diffusion_rollout import EmbeddedEngine
        from omni_adapters import from_pretrained

        r = self.recipe
        if r.trainer.threads:
            torch.set_num_threads(r.trainer.threads)
        quiet_libraries()
        self.loss_fn = _loss_fn(r)
        path = ensure_model(r)
        try:
            self.adapter = from_pretrained(
                path, dtype=r.model.dtype, device=r.model.device, **r.model.options
            )
        except (ValueError, FileNotFoundError) as exc:
            raise TrainError(f"model.path: cannot load {path}: {exc}") from None
        if r.lora.enabled:
            torch.manual_seed(r.lora.init_seed)
            try:
                self.lora_modules = self.adapter.add_lora(
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
            set_full_trainable(self.adapter, r)
            self.lora_modules = 0
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
        inputs = r.reward.inputs
        if "audio" in inputs and not hasattr(self.adapter, "decode_av"):
            raise TrainError(
                f"reward.inputs: audio needs a video+audio model (ltx2); "
                f"{type(self.adapter).__name__} makes no waveform"
            )
        # the rollout decodes only when the reward reads pixels (audio: decoded here, jointly)
        decode = "media" in inputs and "audio" not in inputs
        self.params = r.sampling_params(output="both" if decode else "latent")
        try:  # a size the model cannot take fails here, not deep inside the first rollout
            self.adapter.latent_shape(self.params)
        except ValueError as exc:
            raise RecipeError(f"rollout.{exc} for {type(self.adapter).__name__}") from None
        self.engine = EmbeddedEngine(self.adapter, max_num_seqs=r.rollout.max_num_seqs)
        self.data = PromptData.from_config(r.data, r.trainer.seed)
        # `reward.distill`: the latent reward model is fitted here, before it is loaded
        ensure_latent_scorer(r, self.engine, r.sampling_params(), self.data.prompts)
        self.reward = build_reward(r)
        self._setup_done = True

    # -------------------------------------------------------------- rollout
    def rollout(self, step: int) -> StepBatch:
        from diffusion_rollout import RolloutRequest

        r = self.recipe
        prompts_step = self.data.prompts_for_step(step)
        # An image-conditioned model (Qwen-Image-Edit) gets each row's source image; the
        # rows are the same pure function of (seed, step) as the prompts.
        images_step: list[Any] = [None] * len(prompts_step)
        if getattr(getattr(self, "adapter", None), "needs_images", False):
            why = self.data.missing_image()
            if why is not None:
                raise TrainError(
                    f"data.file: the model ({type(self.adapter).__name__}) is image-conditioned "
                    f"and needs a source image per row; {why}"
                )
            images_step = self.data.images_for_step(step)
        prompts, group_ids, seeds, reqs = [], [], [], []
        for g, (prompt, image) in enumerate(zip(prompts_step, images_step)):
            for _ in range(r.rollout.n):
                i = len(prompts)
                seed = sample_seed(r.trainer.seed, step, i)
                prompts.append(prompt)
                group_ids.append(g)
                seeds.append(seed)
                reqs.append(
                    RolloutRequest(
                        prompt=prompt,
                        seed=seed,
                        params=self.params,
                        request_id=f"s{step}-{i}",
                        image=image,
                    )
                )
        before = self.engine.stats()
        trajs = self.engine.generate_many(reqs)
        after = self.engine.stats()
        forwards = after["forwards"] - before["forwards"]
        self.rollout_stats = {
            "rollout/forwards": forwards,
            "rollout/rows_per_forward": (after["rows"] - before["rows"]) / max(forwards, 1),
        }
        return StepBatch(prompts, group_ids, seeds, list(trajs))

    # -------------------------------------------------------------- reward
    def score(self, batch: StepBatch, step: int) -> None:
        from omni_rewards import RewardError

        r = self.recipe
        grid = bool(r.trainer.sample_every) and (
            step % r.trainer.sample_every == 0 or step + 1 == r.trainer.steps
        )
        inp, media, _ = self.reward_input(batch.trajectories, batch.prompts, self.params, grid)
        batch.images = None if media is None else still_frames(media)
        try:
            out = self.reward(inp)
        except RewardError as exc:
            if "non-finite" in str(exc):
                path = self.save_bad_samples(batch, step, None, "reward")
                raise NonFiniteError(
                    f"step {step}: non-finite reward ({exc}); samples saved to {path}"
                ) from None
            raise TrainError(f"step {step}: reward failed: {exc}") from None
        scores = np.asarray(out.scores, dtype=np.float64)
        bad = ~np.isfinite(scores)
        if bad.any():
            path = self.save_bad_samples(batch, step, scores, "reward")
            raise NonFiniteError(
                f"step {step}: reward is NaN/inf for {int(bad.sum())} of {len(scores)} samples "
                f"(indices {np.flatnonzero(bad)[:8].tolist()}); samples saved to {path}"
            )
        batch.rewards = scores
        batch.reward_details = {
            k: np.asarray(v) for k, v in (out.details or {}).items() if np.asarray(v).ndim == 1
        }

    def reward_input(
        self, trajs: list[Any], prompts: list[str], params: Any, pixels: bool = False
    ) -> tuple[Any, np.ndarray | None, np.ndarray | None]:
        """What the reward sees of a batch (`reward.inputs`): decoded media, the clean final
        latents, the waveform. Returns `(RewardInput, media or None, waveforms
        or None)`; media is (B, H, W, 3) or (B, F, H, W, 3) uint8. A latent-only reward gets no decode unless `pixels` asks for pictures (the
        sample grid, validation)."""
        from omni_rewards import RewardInput

        inputs = self.recipe.reward.inputs
        fields: dict[str, Any] = {"prompts": prompts}
        media = waves = None
        if "audio" in inputs:  # video+audio: frames and waveform from one decode
            with torch.no_grad():
                av = self.adapter.decode_av(_stack(trajs, "final_latent"), params)
            media = av["frames"].cpu().numpy()
            waves = av["waveform"].float().cpu().numpy()
            fields.update(audio=waves, sample_rate=int(av["sample_rate"]))
        elif trajs[0].media is not None:
            media = _stack(trajs, "media").numpy()
        elif pixels:
            media = self.adapter.decode(_stack(trajs, "final_latent")).cpu().numpy()
        if "media" in inputs:
            assert media is not None  # the rollout decodes whenever `media` is asked for
            fields.update(media_fields(media))
        if "latents" in inputs:
            fields["latents"] = _stack(trajs, "final_latent").float().numpy()
        return RewardInput(**fields), media, waves

    def save_bad_samples(
        self, batch: StepBatch, step: int, scores: np.ndarray | None, what: str
    ) -> Path:
        """Write the step's images and a JSON of prompts/seeds/rewards to nonfinite/step_XXXX."""
        out = self.run_dir / "nonfinite" / f"step_{step:04d}"
        out.mkdir(parents=True, exist_ok=True)
        if batch.images is not None:
            save_sample_grid(batch.images, out / "samples.png", cols=self.recipe.rollout.n)
        rows = []
        for i, (p, s) in enumerate(zip(batch.prompts, batch.seeds)):
            v = None if scores is None else float(scores[i])
            rows.append(
                {
                    "index": i,
                    "prompt": p,
                    "seed": s,
                    "reward": v if v is None or math.isfinite(v) else str(v),
                }
            )
        (out / "samples.json").write_text(json.dumps({"what": what, "samples": rows}, indent=1))
        return out

    # -------------------------------------------------------------- update
    def update(self, batch: StepBatch, step: int) -> dict[str, float]:
        from diffusion_rollout import stack_conditions
        from omni_algos import sde
        from omni_algos.advantages import group_advantages
        from omni_algos.losses import kl_penalty

        r = self.recipe
        a = r.algorithm
        if a.name in FORWARD_PROCESS_LOSSES:  # DiffusionNFT / DPO: no SDE replay
            return forward_process_update(self, batch, step)
        trajs = batch.trajectories
        rewards = torch.as_tensor(batch.rewards, dtype=torch.float32)
        adv = group_advantages(rewards, torch.as_tensor(batch.group_ids), std=a.adv_std)
        adv = adv.clamp(-a.adv_clip_max, a.adv_clip_max)

        lat = _stack(trajs, "latents")  # (B, W+1, ...)
        old_lp = _stack(trajs, "log_probs").float()  # (B, W)
        sig = _stack(trajs, "sigmas").float()
        sig_next = _stack(trajs, "sigmas_next").float()
        cond = stack_conditions([t.condition for t in trajs])
        B, W = old_lp.shape
        mb = B // a.num_minibatches
        params = list(self.params_named.values())

        sums: dict[str, float] = {}
        counts: dict[str, int] = {}

        def acc(key: str, value: float) -> None:
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1

        def replay(idx: torch.Tensor, j: int, grad: bool = True):
            c = {key: v[idx] for key, v in cond.items()}
            fn = self.adapter.replay_velocity if grad else self.adapter.velocity
            v = fn(lat[idx, j], sig[idx, j], c, self.params)
            return sde.step(
                lat[idx, j],
                v,
                sig[idx, j],
                sig_next[idx, j],
                noise_level=r.rollout.noise_level,
                kind=r.rollout.sde_kind,
                prev_sample=lat[idx, j + 1],
            )

        # losses that compare against the rollout policy's Gaussian mean (Flow-DPPO,
        # GRPO-Guard) get it from one no-grad replay on the rollout weights
        old_mean: list[torch.Tensor] | None = None
        if "old_mean" in inspect.signature(self.loss_fn).parameters:
            with torch.no_grad():
                everyone = torch.arange(B)
                old_mean = [replay(everyone, j, grad=False).mean for j in range(W)]

        # rollout correction: when the rollout engine's log-probs differ from the trainer's
        # (bf16 or another engine), weight or reject samples (omni_algos.correction)
        anchor, corr_w, corr_metrics = old_lp, None, {}
        if a.rollout_correction != "off":
            from omni_algos.correction import rollout_correction

            if "weights" not in inspect.signature(self.loss_fn).parameters:
                raise TrainError(
                    f"algorithm.rollout_correction: {a.name} takes no per-sample `weights`"
                )
            with torch.no_grad():
                everyone = torch.arange(B)
                prox = torch.stack(
                    [replay(everyone, j, grad=False).log_prob.float() for j in range(W)], dim=1
                )
            cc = rollout_correction(prox, old_lp, mode=a.rollout_correction, is_level="token")
            corr_w = cc.weights.float()
            if a.rollout_correction == "decoupled":  # the trainer's log-probs anchor the ratio
                anchor = prox
            corr_metrics = {f"rollout/correction_{k}": v for k, v in cc.metrics.items()}

        first_pass_diffs: list[torch.Tensor] = []
        for epoch in range(a.epochs):
            g = torch.Generator().manual_seed(
                derive_seed(r.trainer.seed, step, epoch, DOMAIN_MINIBATCH)
            )
            perm = torch.randperm(B, generator=g) if a.num_minibatches > 1 else torch.arange(B)
            for k in range(a.num_minibatches):
                rows = perm[k * mb : (k + 1) * mb]
                self.optimizer.zero_grad(set_to_none=True)
                loss_total = 0.0
                # gradient accumulation: the minibatch's rows in `grad_accumulation` chunks;
                # each chunk's (row-mean) loss is weighted by its share of the rows, so the
                # summed gradient is the whole minibatch's
                for idx in rows.chunk(min(r.optimizer.grad_accumulation, len(rows))):
                    share = len(idx) / len(rows)
                    for j in range(W):
                        out = replay(idx, j)
                        if epoch == 0 and k == 0:  # minibatch 0 runs on the rollout weights
                            first_pass_diffs.append((out.log_prob.detach() - old_lp[idx, j]).abs())
                        lo = _call_loss(
                            self.loss_fn,
                            log_prob=out.log_prob,
                            old_log_prob=anchor[idx, j],
                            advantages=adv[idx],
                            weights=None if corr_w is None else corr_w[idx, j],
                            mean=out.mean,
                            old_mean=None if old_mean is None else old_mean[j][idx],
                            std=out.std,
                            sqrt_dt=out.sqrt_dt,
                            clip_range=a.clip_range,
                            adv_clip_max=a.adv_clip_max,
                            **a.options,
                        )
                        if a.kl_beta > 0:  # KL to the reference (the base model, LoRA off)
                            with torch.no_grad(), self.adapter.disabled_adapters():
                                ref = replay(idx, j, grad=False)
                            step_std = (
                                out.std * out.sqrt_dt if r.rollout.sde_kind == "sde" else out.std
                            )
                            kl = kl_penalty(out.mean, ref.mean, step_std)
                            lo.loss = lo.loss + a.kl_beta * kl.loss
                            acc("actor/kl_ref", kl.metrics["kl"])
                        if not torch.isfinite(lo.loss):
                            path = self.save_bad_samples(batch, step, batch.rewards, "loss")
                            raise NonFiniteError(
                                f"step {step}: loss is {float(lo.loss)} (window step {j}, minibatch "
                                f"{k}); samples saved to {path}"
                            )
                        (lo.loss * share / W).backward()
                        loss_total += float(lo.loss.detach()) * share / W
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
        if first_pass_diffs:
            d = torch.cat(first_pass_diffs)
            metrics["rollout/logprob_diff_max"] = float(d.max())
            metrics["rollout/logprob_diff_mean"] = float(d.mean())
        metrics["actor/adv_abs_mean"] = float(adv.abs().mean())
        metrics.update(corr_metrics)
        return metrics

    # -------------------------------------------------------------- sync
    def sync_weights(self, version: int) -> None:
        tensors = self.adapter.export_rollout_weights()
        self.engine.update_weights(tensors, version=version)
        self.version = version

    # -------------------------------------------------------------- validation
    def validate(self, step: int) -> dict[str, float]:
        """Deterministic ODE sampling (noise 0) on the fixed validation prompts."""
        from diffusion_rollout import RolloutRequest

        r = self.recipe
        prompts = list(r.data.val_prompts or self.data.prompts[: r.data.prompts_per_step])
        params = r.sampling_params(
            sde_kind="ode",
            noise_level=0.0,
            num_steps=r.trainer.val_num_steps or r.rollout.num_steps,
            sde_window_size=None,
            sde_window_range=None,
        )
        reqs, vprompts = [], []
        for pi, prompt in enumerate(prompts):
            for k in range(r.trainer.val_samples_per_prompt):
                seed = derive_seed(r.trainer.seed, 0, pi * 1000 + k, DOMAIN_VAL)
                reqs.append(
                    RolloutRequest(
                        prompt=prompt,
                        seed=seed,
                        params=params,
                        request_id=f"val{step}-{len(reqs)}",
                        image=self.data.val_image(pi)
                        if getattr(self.adapter, "needs_images", False)
                        else None,
                    )
                )
                vprompts.append(prompt)
        if self.ema:
            with self.adapter.use_adapter("ema"):
                trajs = self.engine.generate_many(reqs)
        else:
            trajs = self.engine.generate_many(reqs)
        inp, media, waves = self.reward_input(trajs, vprompts, params, pixels=True)
        out = self.reward(inp)
        scores = np.asarray(out.scores, dtype=np.float64)
        assert media is not None
        samples = self.run_dir / "samples"
        if media.ndim == 5:  # video: the first sample's frames side by side
            save_frame_strip(media[0], samples / f"val_step_{step:04d}_frames.png")
        if waves is not None:
            save_waveform_plot(
                waves[0], int(inp.sample_rate), samples / f"val_step_{step:04d}_audio.png"
            )
        save_sample_grid(
            still_frames(media),
            self.run_dir / "samples" / f"val_step_{step:04d}.png",
            cols=r.trainer.val_samples_per_prompt,
            labels=[f"{s:.3f}" for s in scores],
        )
        return {"val/reward_mean": float(scores.mean()), "val/reward_std": float(scores.std())}

    # -------------------------------------------------------------- checkpoints
    def save(self, step: int) -> Path:
        lora_tensors = lora_cfg = None
        extra: dict[str, bytes] = {}
        if self.recipe.lora.enabled:
            lora_tensors = self.adapter.export_rollout_weights(fmt="peft")
            lora_cfg = self.adapter.lora_config()
            from safetensors.torch import save as st_save

            diffusers_names = {
                "transformer." + k.removeprefix("base_model.model."): v
                for k, v in lora_tensors.items()
            }
            # diffusers reads the LoRA config (rank, alpha, targets) from this metadata key
            meta = {f"transformer.{k}": v for k, v in lora_cfg.items()}
            extra["pytorch_lora_weights.safetensors"] = st_save(
                diffusers_names,
                metadata={
                    "format": "pt",
                    "lora_adapter_metadata": json.dumps(meta, sort_keys=True),
                },
            )
        return save_checkpoint(
            self.run_dir / "checkpoint",
            step,
            self._trainable_state(),
            self.optimizer,
            state={"version": self.version, "experiment": self.recipe.experiment},
            lora_tensors=lora_tensors,
            lora_config=lora_cfg,
            lora_files=extra,
            keep=self.recipe.trainer.keep_checkpoints,
        )

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        """Trainable parameters by name, plus the EMA tensors under `ema/` when on."""
        out = {k: p.detach() for k, p in self.params_named.items()}
        if self.ema:
            out.update(
                {f"ema/{k}": v.detach() for k, v in self.adapter.adapter_state("ema").items()}
            )
        return out

    def restore(self, path: str | Path) -> int:
        ck = load_checkpoint(path)
        ema = {k.removeprefix("ema/"): v for k, v in ck.trainable.items() if k.startswith("ema/")}
        ck.trainable = {k: v for k, v in ck.trainable.items() if not k.startswith("ema/")}
        if self.ema:
            if not ema:
                raise TrainError(f"checkpoint {ck.path} has no EMA weights (optimizer.ema_decay)")
            with torch.no_grad():
                for k, t in self.adapter.adapter_state("ema").items():
                    t.copy_(ema[k].to(t.device, t.dtype))
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
                plot_reward_curve(all_rows, self.run_dir / "reward_curve.png", title=r.experiment)
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
        assert rw is not None
        row: dict[str, Any] = {
            "step": step,
            "reward/mean": float(rw.mean()),
            "reward/std": float(rw.std()),
            "reward/min": float(rw.min()),
            "reward/max": float(rw.max()),
        }
        for k, v in batch.reward_details.items():
            if np.issubdtype(v.dtype, np.number) and v.shape == rw.shape:
                row[f"reward/{k}_mean"] = float(np.nanmean(v))
        row.update(metrics)
        row["rollout/rows"] = len(batch.trajectories)
        row.update(getattr(self, "rollout_stats", {}))
        row["rollout/version"] = int(batch.trajectories[0].version)
        row["weights/version"] = self.version
        self.step = step + 1
        if r.trainer.sample_every and (
            step % r.trainer.sample_every == 0 or step + 1 == r.trainer.steps
        ):
            assert batch.images is not None
            path = save_sample_grid(
                batch.images,
                self.run_dir / "samples" / f"step_{step:04d}.png",
                cols=r.rollout.n,
                labels=[f"{s:.3f}" for s in rw],
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
        row["timing/rollout_s"] = t1 - t0
        row["timing/reward_s"] = t2 - t1
        row["timing/update_s"] = t3 - t2
        row["timing/val_s"] = t5 - t4
        row["timing/save_s"] = t6 - t5
        row["timing/step_s"] = t6 - t0
        row["perf/images_per_s"] = len(batch.trajectories) / max(t1 - t0, 1e-9)
        logger.log(row)
        return row


# ---------------------------------------------------------------------------------------------
# entry points


def train(recipe: Recipe, run_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Run a recipe from step 0; returns the per-step metric rows."""
    if recipe.is_omni():  # autoregressive thinker + GSPO/GRPO: the omni loop
        if recipe.trainer.backend == "verl":  # hand the omni path to verl's PPO trainer
            from .backends import run_backend

            return run_backend(recipe, run_dir)
        if recipe.trainer.backend != "local":
            raise TrainError(
                f"trainer.backend: the omni path (algorithm {recipe.algorithm.name}) runs with "
                f"`local` only for now, got {recipe.trainer.backend!r}"
            )
        from .omni_loop import OmniTrainer

        return OmniTrainer(recipe, run_dir).train()
    if recipe.trainer.backend != "local":
        from .backends import run_backend

        return run_backend(recipe, run_dir)
    return LocalTrainer(recipe, run_dir).train()


def resume(run: str | Path, overrides: list[str] | None = None) -> list[dict[str, Any]]:
    """Continue `run` from its latest checkpoint (its saved recipe plus `overrides`)."""
    run = Path(run)
    recipe_path = run / "recipe.yaml"
    if not recipe_path.is_file():
        raise TrainError(f"resume: {run} is not a run folder (no recipe.yaml)")
    ck = latest_checkpoint(run / "checkpoint")
    if ck is None:
        raise TrainError(f"resume: {run} has no complete checkpoint under {run / 'checkpoint'}")
    recipe = load_recipe(recipe_path, [*list(overrides or []), f"trainer.output_dir={run}"])
    if recipe.is_omni():
        from .omni_loop import OmniTrainer

        return OmniTrainer(recipe, run).train(resume_from=ck)
    trainer = LocalTrainer(recipe, run)
    return trainer.train(resume_from=ck)
