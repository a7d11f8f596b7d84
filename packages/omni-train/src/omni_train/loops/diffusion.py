"""The diffusion training loop, top to bottom, for every backend.

One step (FlowGRPO: Liu et al. 2025, arXiv 2505.05470; the other algorithms of
`omni_train.algorithms` change only step 4):

1. Rollout. P prompts (`data.prompts_per_step`), each repeated `rollout.n` times under one
   group id; sample i of step s gets the seed `sample_seed(run_seed, s, i)` and one
   `RolloutRequest`. The rollout port returns one `Trajectory` per request: the latents of its
   SDE window, their log-probs, sigmas, the final latent and (when asked) decoded media.
   With `trainer.mode: async` the rollout of step s+1 already ran during step s's update.
2. Reward. The reward scores what `reward.inputs` names: decoded media, final latents, or
   the waveform of a video+audio model.
3. Advantages. Group-relative (`omni_algos.advantages.group_advantages`), clipped to
   +-`algorithm.adv_clip_max`.
4. Update. The algorithm's update step (`omni_train.updates`) on the learner: the SDE replay
   (or, with `algorithm.reuse_rollout_forward`, a backward through the rollout's own
   forwards), or the forward-process losses on the re-noised final latents.
5. Weight sync. The learner's rollout weights go to the rollout as version s + 1.
6. Record. One metrics row; sample grids, validation and checkpoints at their cadence.

The backends (`omni_train.backends`) differ only in the ports they hand this loop.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..algorithms import algorithm
from ..data import PromptData
from ..errors import NonFiniteError, TrainError
from ..latent_scorer import ensure_latent_scorer
from ..plots import (
    save_frame_strip,
    save_prompt_grid,
    save_sample_grid,
    save_waveform_plot,
    score_labels,
)
from ..ports import Ports
from ..recipe import Recipe
from ..seeds import DOMAIN_VAL, derive_seed, sample_seed
from ..updates import forward_draws, pair_batch, replay_batch, sample_batch
from .run import RunFolder, sample_due, save_due, val_due
from .schedule import (
    CoreShare,
    PrefetchRollout,
    RolloutHistory,
    SyncRollout,
    staleness_stats,
    usable_cores,
)

__all__ = ["DiffusionLoop", "media_fields", "reward_overlaps", "still_frames"]


def media_fields(media: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 media as `RewardInput` fields: (B, H, W, 3) images or (B, F, H, W, 3) videos."""
    return {"videos": media} if media.ndim == 5 else {"images": media}


def still_frames(media: np.ndarray) -> np.ndarray:
    """One picture per sample for the grids: the image, or a video's middle frame."""
    return media[:, media.shape[1] // 2] if media.ndim == 5 else media


def nan_mean(values: Any) -> float:
    """The mean of the values that are not NaN, or NaN when none is: a reward detail such as
    ``task_counting`` is NaN for the samples it does not apply to, and a batch may hold none
    (``np.nanmean`` would warn "Mean of empty slice" into every step's log)."""
    arr = np.asarray(values, dtype=np.float64)
    kept = arr[~np.isnan(arr)]
    return float(kept.mean()) if kept.size else float("nan")


def group_stats(rewards: np.ndarray, n: int, trajs: list[Any]) -> dict[str, float]:
    """Per prompt group of ``n`` samples: the fraction of groups whose rewards are all equal
    (no advantage, no gradient: `reward/frac_zero_std`), and how different the group's
    samples are (`samples/diversity`: the mean per-element std of a group's final latents over
    the std of all of them; 0 = a collapsed group, ~1 = as varied as the batch)."""
    groups = rewards.reshape(-1, n)
    out = {"reward/frac_zero_std": float((groups.std(axis=1) < 1e-8).mean())}
    if trajs and trajs[0].final_latent is not None:
        lat = torch.stack([t.final_latent for t in trajs]).float()
        lat = lat.reshape(-1, n, *lat.shape[1:])
        spread = float(lat.std())
        if spread > 0:
            out["samples/diversity"] = float(lat.std(dim=1).mean()) / spread
    return out


def reward_overlaps(recipe: Recipe, torch_threads: int, cores: int) -> bool:
    """Whether a sync step scores each finished wave in the reward thread while the next
    waves roll out (`reward.overlap`; the rollout port decides whether it has waves).

    `auto`: always where the rollout runs on a GPU (the CPU is free meanwhile). Where it runs
    on the CPU, only for an `http` reward (it waits for its server) and only while the
    rollout's ``torch_threads`` leave one of the ``cores`` free: a reward thread beside a
    team of torch threads on every core slowed the rollout more than it hid, even one that
    only sleeps, and with a core left free a reward that computes on the CPU gained little
    or lost (`benchmarks/reward_overlap.py`, docs/performance.md). Audio rewards score after
    the rollout (they read the whole batch)."""
    r = recipe.reward
    if r.overlap != "auto":  # `true` where it cannot run is refused (Recipe._overlap_problems)
        return r.overlap
    if recipe.trainer.mode != "sync" or "audio" in r.inputs:
        return False
    if recipe.model.device != "cpu":
        return True
    names = [term.name for term in r.terms] if r.terms else [r.name]
    return all(name == "http" for name in names) and torch_threads < cores


def _stack(trajs: list[Any], attr: str) -> torch.Tensor:
    return torch.stack([getattr(t, attr) for t in trajs])


class DiffusionLoop:
    """Trains a diffusion model with the ports of `trainer.backend` (see the module docstring)."""

    def __init__(self, recipe: Recipe, ports: Ports, run_dir: str | Path | None = None) -> None:
        self.recipe = recipe
        self.ports = ports
        self.run_dir = Path(run_dir) if run_dir is not None else recipe.output_dir()
        self.algorithm = algorithm(recipe.algorithm.name)
        self.learner = ports.learner
        self.data = PromptData.from_config(recipe.data, recipe.trainer.seed)
        if ports.needs_images:
            why = self.data.missing_image()
            if why is not None:
                raise TrainError(
                    "data.file: the model is image-conditioned and needs a source image per "
                    f"row; {why}"
                )
        inputs = recipe.reward.inputs
        if "audio" in inputs and ports.decode_av is None:
            raise TrainError(
                "reward.inputs: audio needs a video+audio model (ltx2) on a backend that can "
                "decode its waveform (trainer.backend local)"
            )
        # the training rollout decodes only when the reward reads pixels (audio: decoded here)
        self.decode = "media" in inputs and "audio" not in inputs
        self.version = 0
        self.params = recipe.sampling_params()
        # `reward.distill`: the latent reward model is fitted before the reward loads it
        ensure_latent_scorer(recipe, ports.rollout, self.params, self.data.prompts)
        self.reward = ports.make_reward()

    # ------------------------------------------------------------------ 1. rollout requests
    def sampling_params(self, step: int, pixels: bool) -> Any:
        """The step's `SamplingParams`: MixGRPO places the one shared SDE window of the step
        (`omni_algos.sde.mix_grpo_window`); ``pixels`` asks the rollout to decode."""
        from omni_algos.sde import mix_grpo_window

        r = self.recipe.rollout
        change: dict[str, Any] = {"output": "both" if pixels else "latent"}
        if self.algorithm.window == "mix_grpo":
            m = self.recipe.algorithm.mix_window
            start, end = mix_grpo_window(
                step,
                r.num_steps,
                r.sde_window_size,
                placement=m.placement,
                seed=self.recipe.trainer.seed,
                shift_interval=m.shift_interval,
                stride=m.stride,
                low=r.sde_window_range[0],
                high=r.sde_window_range[1],
            )
            change.update(sde_window_range=(start, end), ode_stride_after_window=m.ode_stride)
        return self.params.replace(**change)

    def requests_for(self, step: int) -> list[Any]:
        """Step's requests: a pure function of (run seed, step)."""
        from diffusion_rollout import RolloutRequest

        r = self.recipe
        params = self.sampling_params(step, pixels=self.decode or sample_due(self.recipe, step))
        prompts = self.data.prompts_for_step(step)
        images: list[Any] = [None] * len(prompts)
        if self.ports.needs_images:
            images = self.data.images_for_step(step)
        reqs = []
        for prompt, image in zip(prompts, images):
            for _ in range(r.rollout.n):
                i = len(reqs)
                reqs.append(
                    RolloutRequest(
                        prompt=prompt,
                        seed=sample_seed(r.trainer.seed, step, i),
                        params=params,
                        request_id=f"s{step}-{i}",
                        image=image,
                    )
                )
        return reqs

    # ------------------------------------------------------------------ 2. reward
    def reward_input(
        self, trajs: list[Any], pixels: bool = False
    ) -> tuple[Any, np.ndarray | None, np.ndarray | None]:
        """What the reward sees of a batch (`reward.inputs`): decoded media, the clean final
        latents, the waveform. Returns `(RewardInput, media or None, waveforms or None)`;
        media is (B, H, W, 3) or (B, F, H, W, 3) uint8."""
        from omni_rewards import RewardInput

        inputs = self.recipe.reward.inputs
        fields: dict[str, Any] = {"prompts": [t.prompt for t in trajs]}
        media = waves = None
        if "audio" in inputs:  # video+audio: frames and waveform from one decode
            assert self.ports.decode_av is not None
            with torch.no_grad():
                av = self.ports.decode_av(_stack(trajs, "final_latent"), trajs[0].params)
            media = av["frames"].cpu().numpy()
            waves = av["waveform"].float().cpu().numpy()
            fields.update(audio=waves, sample_rate=int(av["sample_rate"]))
        elif trajs[0].media is not None:
            media = _stack(trajs, "media").numpy()
        if "media" in inputs:
            if media is None:
                raise TrainError("rollout: the reward reads media but the rollout decoded none")
            fields.update(media_fields(media))
        if "latents" in inputs:
            fields["latents"] = _stack(trajs, "final_latent").float().numpy()
        return RewardInput(**fields), media, waves

    def score(
        self, trajs: list[Any], step: int, parts: list[Any] | None = None
    ) -> tuple[np.ndarray, dict[str, np.ndarray], Any]:
        """Rewards (float64), per-sample numeric details, and the media for grids.

        ``parts``: the batch already scored in pieces while it rolled out (futures of
        ``(first index, RewardOutput, seconds)``, see `train_step`); else scored here.
        `reward_busy_s` is the time the reward computed, hidden or not."""
        from omni_rewards import RewardError, RewardOutput

        inp, media, _ = self.reward_input(trajs)
        try:
            if parts:
                outs = sorted((f.result() for f in parts), key=lambda p: p[0])
                out = RewardOutput.concat([o for _, o, _ in outs])
                self.reward_busy_s = sum(dt for _, _, dt in outs)
            else:
                t0 = time.perf_counter()
                out = self.reward(inp)
                self.reward_busy_s = time.perf_counter() - t0
        except RewardError as exc:
            if "non-finite" in str(exc):
                path = self.save_bad_samples(trajs, media, step, None, "reward")
                raise NonFiniteError(
                    f"step {step + 1}: non-finite reward ({exc}); samples saved to {path}"
                ) from None
            raise TrainError(f"step {step + 1}: reward failed: {exc}") from None
        scores = np.asarray(out.scores, dtype=np.float64)
        bad = ~np.isfinite(scores)
        if bad.any():
            path = self.save_bad_samples(trajs, media, step, scores, "reward")
            raise NonFiniteError(
                f"step {step + 1}: reward is NaN/inf for {int(bad.sum())} of {len(scores)} samples "
                f"(indices {np.flatnonzero(bad)[:8].tolist()}); samples saved to {path}"
            )
        details = {}
        for k, v in (out.details or {}).items():
            arr = np.asarray(v)
            if arr.ndim == 1 and np.issubdtype(arr.dtype, np.number) and arr.shape == scores.shape:
                details[k] = arr
        return scores, details, media

    def reuse_does_not_fit(self, message: str) -> None:
        """`algorithm.reuse_rollout_forward: auto` whose batch graph would not fit: said on the
        console, and the run goes on replaying (`SyncRollout`)."""
        first = message.split(". ")[0]
        self.run.say(f"{first}; auto: the update replays the trained steps from now on")

    def save_bad_samples(
        self, trajs: list[Any], media: Any, step: int, scores: np.ndarray | None, what: str
    ) -> Path:
        """The step's images and a JSON of prompts/seeds/rewards under nonfinite/step_XXXX."""
        out = self.run_dir / "nonfinite" / f"step_{step + 1:04d}"
        out.mkdir(parents=True, exist_ok=True)
        if media is not None:
            save_sample_grid(still_frames(media), out / "samples.png", cols=self.recipe.rollout.n)
        rows = []
        for i, t in enumerate(trajs):
            v = None if scores is None else float(scores[i])
            rows.append(
                {
                    "index": i,
                    "prompt": t.prompt,
                    "seed": t.seed,
                    "reward": v if v is None or math.isfinite(v) else str(v),
                }
            )
        (out / "samples.json").write_text(json.dumps({"what": what, "samples": rows}, indent=1))
        return out

    # ------------------------------------------------------------------ 3.-4. update batch
    def update_batch(
        self, trajs: list[Any], rewards: np.ndarray, step: int
    ) -> tuple[Any, dict[str, float]]:
        """The algorithm's update batch (`omni_train.updates`) and metrics about it."""
        from omni_algos.advantages import group_advantages
        from omni_algos.losses import pair_by_reward

        a = self.recipe.algorithm
        seed = self.recipe.trainer.seed
        # requests go prompt by prompt, n samples each: sample i belongs to group i // n
        group_ids = torch.arange(len(trajs)) // self.recipe.rollout.n
        rw = torch.as_tensor(rewards, dtype=torch.float32)
        if self.algorithm.pairs:  # online DPO: the best vs the worst samples of each group
            win, lose = pair_by_reward(rewards, group_ids, a.pairs_per_group)
            if len(win) == 0:
                return None, {"actor/pairs": 0.0}
            shape = (len(win), *trajs[0].final_latent.shape)
            draws = forward_draws(seed, step, a.train_timesteps, shape, a.timestep_range)
            gap = float((rw[win] - rw[lose]).double().mean())
            info = {"actor/pairs": float(len(win)), "actor/pair_reward_gap": gap}
            return pair_batch(trajs, win, lose, draws), info
        adv = group_advantages(rw, group_ids, std=a.adv_std)
        info = {"actor/adv_abs_mean": float(adv.abs().mean())}
        if self.algorithm.kind == "forward_process":  # NFT clips inside its loss
            shape = (len(trajs), *trajs[0].final_latent.shape)
            draws = forward_draws(seed, step, a.train_timesteps, shape, a.timestep_range)
            return sample_batch(trajs, adv, draws), info
        adv = adv.clamp(-a.adv_clip_max, a.adv_clip_max)
        return replay_batch(trajs, adv), info

    # ------------------------------------------------------------------ validation
    def validation_set(self) -> tuple[list[str], list[Any], bool]:
        """(prompts, their condition images or Nones, held out?): `data.val_prompts`, else
        `data.val_file`'s rows, else the first training prompts (not held out)."""
        from ..data import read_data_file

        d = self.recipe.data
        needs = self.ports.needs_images
        if d.val_file is not None:
            rows = read_data_file(d.val_file, "data.val_file")
            if needs and any(row.image is None for row in rows):
                raise TrainError(
                    "data.val_file: the model is image-conditioned; every validation row "
                    "needs an 'image'"
                )
            return [row.prompt for row in rows], [row.image for row in rows], True
        if d.val_prompts:
            prompts = list(d.val_prompts)  # row i's image when the model takes one
            return prompts, [i if needs else None for i in range(len(prompts))], True
        prompts = self.data.prompts[: d.prompts_per_step]
        return prompts, [i if needs else None for i in range(len(prompts))], False

    def validate(self, step: int) -> dict[str, float]:
        """Deterministic ODE sampling (noise 0) of the validation prompts after step ``step``
        (0: before training); per-part means of the reward's details too."""
        from diffusion_rollout import RolloutRequest

        from ..data import ImageRef

        r = self.recipe
        prompts, images, _ = self.validation_set()
        params = r.sampling_params(
            sde_kind="ode",
            noise_level=0.0,
            num_steps=r.trainer.val_num_steps or r.rollout.num_steps,
            sde_window_size=None,
            sde_window_range=None,
            output="both",
        )
        reqs = []
        for pi, (prompt, image) in enumerate(zip(prompts, images)):
            if isinstance(image, ImageRef):
                image = image.load()
            elif isinstance(image, int):
                image = self.data.val_image(image)
            for k in range(r.trainer.val_samples_per_prompt):
                reqs.append(
                    RolloutRequest(
                        prompt=prompt,
                        seed=derive_seed(r.trainer.seed, 0, pi * 1000 + k, DOMAIN_VAL),
                        params=params,
                        request_id=f"val{step}-{len(reqs)}",
                        image=image,
                    )
                )
        with self.learner.eval_weights():
            trajs = self.ports.rollout.generate_many(reqs)
        inp, media, waves = self.reward_input(trajs)
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
        save_prompt_grid(
            still_frames(media),
            samples / f"val_step_{step:04d}.png",
            prompts,
            r.trainer.val_samples_per_prompt,
            labels=score_labels(scores, out.details),
        )
        metrics = {"val/reward_mean": float(scores.mean()), "val/reward_std": float(scores.std())}
        for k, v in (out.details or {}).items():
            arr = np.asarray(v)
            if arr.ndim == 1 and np.issubdtype(arr.dtype, np.number) and len(arr) == len(scores):
                metrics[f"val/{k}_mean"] = nan_mean(arr)
        return metrics

    # ------------------------------------------------------------------ the loop
    def train(self, resume_from: str | Path | None = None) -> list[dict[str, Any]]:
        r = self.recipe
        t = r.trainer
        self.run = RunFolder(r, self.run_dir, fresh=resume_from is None)
        start = 0
        # the weight pushes a resume makes, oldest first: an async checkpoint also holds the
        # older versions its next rollouts were launched on (schedule.RolloutHistory)
        pushes: list[tuple[Any, int]] = []
        if resume_from is not None:
            start, self.version, older = self.run.restore(resume_from, self.learner)
            if t.mode == "async":
                pushes = [(older[v], v) for v in sorted(older)]
            pushes.append((self.learner.rollout_weights(), self.version))
        self.history = None
        if t.mode == "async":
            self.history = RolloutHistory(t.max_staleness, lambda n: save_due(r, n - 1))
            if not pushes:  # a fresh run
                pushes = [(self.learner.rollout_weights(), 0)]
            for tensors, version in pushes:
                self.history.add(tensors, version)
            (tensors, version), *later = pushes
            # a port this process started holds version 0, the initial weights, already (and
            # takes only newer versions); a server at rollout.url may hold anything
            if resume_from is not None and (version > 0 or r.rollout.url is not None):
                self.ports.rollout.update_weights(tensors, version)
            rollout: Any = PrefetchRollout(
                self.ports.rollout,
                self.requests_for,
                max_staleness=t.max_staleness,
                total_steps=t.steps,
                version=version,
                next_step=start,
            )
            if resume_from is not None:
                rollout.resume(later)
        else:
            for tensors, version in pushes:
                self.ports.rollout.update_weights(tensors, version)
            reuse = r.reuses_rollout_forward()
            auto = r.algorithm.reuse_rollout_forward == "auto"
            rollout = SyncRollout(
                self.ports.rollout,
                self.requests_for,
                self.version,
                differentiable=reuse,
                on_does_not_fit=self.reuse_does_not_fit if reuse and auto else None,
            )
        rows: list[dict[str, Any]] = []
        self.run.start(start)
        if t.val_every:
            if not self.validation_set()[2]:
                self.run.say(
                    "validation: no data.val_file or data.val_prompts, so it samples the first "
                    "training prompts (not held out)"
                )
            if start == 0:
                self.run.log_baseline(self.validate(0))
        # scores waves while the next ones roll out in this thread (reward.overlap); one
        # thread keeps the reward's own order. Its torch ops run on one thread: a second
        # OpenMP team beside the rollout's would stop libgomp's spin-waiting in both
        # (diffusion_rollout.EmbeddedEngine, docs/performance.md)
        self.reward_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="reward", initializer=torch.set_num_threads, initargs=(1,)
        )
        share = None  # trainer.threads auto, on a CPU: the cores other processes leave
        local_cpu = t.backend == "local" and r.model.device == "cpu"
        if t.threads == "auto" and t.mode == "sync" and local_cpu:
            share = CoreShare()
        try:
            for step in range(start, t.steps):
                if share is not None:
                    share.update()
                rows.append(self.train_step(step, rollout))
        finally:
            self.reward_pool.shutdown(wait=True, cancel_futures=True)
            rollout.close()
            self.run.finish()
        return rows

    def train_step(self, step: int, rollout: Any) -> dict[str, Any]:
        r = self.recipe
        t0 = time.perf_counter()
        parts: list[Any] = []  # 1 (and 2 for each finished wave, overlapping the next)

        def score_wave(indices: list[int], done: list[Any]) -> None:
            inp, _, _ = self.reward_input(done)

            def run() -> tuple[int, Any, float]:
                t = time.perf_counter()
                out = self.reward(inp)
                return indices[0], out, time.perf_counter() - t

            parts.append(self.reward_pool.submit(run))

        overlap = reward_overlaps(r, torch.get_num_threads(), usable_cores())
        trajs = rollout.collect(step, score_wave if overlap else None)
        t1 = time.perf_counter()
        rewards, details, media = self.score(trajs, step, parts)  # 2 (what is left of it)
        t2 = time.perf_counter()
        batch, info = self.update_batch(trajs, rewards, step)  # 3
        versions = [int(tr.version) for tr in trajs]
        stale = staleness_stats(self.version, versions) if r.trainer.mode == "async" else {}
        correction = None
        if r.algorithm.rollout_correction != "off":
            correction = r.algorithm.rollout_correction
        elif stale.get("async/staleness_max", 0) > 0:
            correction = r.trainer.async_correction
        metrics: dict[str, float] = {}
        if batch is not None:
            try:
                metrics = self.learner.update(batch, step, correction)  # 4
            except NonFiniteError as exc:
                path = self.save_bad_samples(trajs, media, step, rewards, "loss")
                raise NonFiniteError(f"step {step + 1}: {exc}; samples saved to {path}") from None
        self.version = step + 1
        weights = self.learner.rollout_weights()
        rollout.push_weights(weights, self.version)  # 5
        if self.history is not None:
            self.history.add(weights, self.version)
        t3 = time.perf_counter()
        row: dict[str, Any] = {  # 6
            "step": step + 1,
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/min": float(rewards.min()),
            "reward/max": float(rewards.max()),
        }
        for k, v in details.items():
            row[f"reward/{k}_mean"] = nan_mean(v)
        row.update(group_stats(rewards, r.rollout.n, trajs))
        row.update(info)
        row.update(metrics)
        row.update(stale)
        row["rollout/rows"] = len(trajs)
        row["rollout/window_start"] = float(np.mean([tr.window[0] for tr in trajs]))
        row["rollout/window_size"] = float(np.mean([tr.window_size for tr in trajs]))
        row.update(rollout.stats)
        row["rollout/version"] = min(versions)
        row["weights/version"] = self.version
        if sample_due(self.recipe, step) and media is not None:
            path = save_prompt_grid(
                still_frames(media),
                self.run_dir / "samples" / f"step_{step + 1:04d}.png",
                [t.prompt for t in trajs[:: r.rollout.n]],
                r.rollout.n,
                labels=score_labels(rewards, details),
            )
            self.run.logger.log_image("samples", path, step + 1)
        t4 = time.perf_counter()
        if val_due(self.recipe, step):
            row.update(self.validate(step + 1))
        t5 = time.perf_counter()
        if save_due(self.recipe, step):
            older = None if self.history is None else self.history.for_checkpoint(step + 1)
            self.run.save(
                step + 1,
                self.learner,
                self.version,
                diffusers_lora=True,
                row=row,
                rollout_versions=older,
            )
        t6 = time.perf_counter()
        row["timing/rollout_s"] = t1 - t0
        row["timing/reward_s"] = t2 - t1  # what the rollout did not hide
        row["timing/reward_busy_s"] = self.reward_busy_s
        row["timing/update_s"] = t3 - t2
        row["timing/val_s"] = t5 - t4
        row["timing/save_s"] = t6 - t5
        row["timing/step_s"] = t6 - t0
        # over the rollout's own time: in async mode the loop's wait for it can be ~0
        row["perf/images_per_s"] = len(trajs) / max(row["timing/rollout_busy_s"], 1e-9)
        row["perf/torch_threads"] = torch.get_num_threads()
        self.run.log(row)
        return row
