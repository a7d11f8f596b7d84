"""The `Recipe` schema: one YAML file describes a whole training run.

A recipe has the sections ``model``, ``lora``, ``data``, ``rollout``, ``reward``,
``algorithm``, ``optimizer`` and ``trainer`` (plus the top-level ``experiment`` name). Every
section forbids unknown keys, so a typo is an error that names the key and suggests the
closest valid one instead of being silently ignored.

``load_recipe(path, overrides)`` reads the YAML, applies ``key=value`` dotted overrides (the
value is parsed as a YAML scalar, so ``trainer.steps=3`` is an int and ``lora.target_modules=[a,b]``
a list) and validates the result.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .algorithms import ALGORITHMS


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the offending key."""


#: tiny families of the omni (autoregressive) path; see `Recipe.is_omni`
OMNI_FAMILIES = ("qwen3_omni_thinker",)

#: keys only one of the two loops reads (`Recipe.is_omni`): the diffusion loop's sampler and
#: validation grids, the omni loop's decoding and answer extraction. Set to other than its
#: default on the other path, a key would do nothing there, so `Recipe.check` refuses it.
DIFFUSION_ONLY_KEYS = {
    "rollout": (
        "height",
        "width",
        "num_frames",
        "num_steps",
        "guidance_scale",
        "true_cfg_scale",
        "noise_level",
        "sde_kind",
        "sde_window_size",
        "sde_window_range",
    ),
    "trainer": ("val_num_steps", "val_samples_per_prompt"),
}
OMNI_ONLY_KEYS = {
    "rollout": ("max_new_tokens", "temperature", "top_p", "val_temperature", "allowed_tokens"),
    "reward": ("extract",),
}

#: keys that were renamed: old dotted key -> what to write instead
RENAMED_KEYS = {
    "trainer.tensorboard": "trainer.report_to: [tensorboard]",
    "trainer.wandb": "trainer.report_to: [wandb]",
    "optimizer.grad_accumulation": (
        "algorithm.rows_per_forward (the most rows one forward pass takes; a minibatch is "
        "split into micro-batches of that size, so the optimizer step stays the same: unlike "
        "trl's gradient_accumulation_steps it never changes the batch per step)"
    ),
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def differs_from_default(self, name: str) -> bool:
        """Whether the recipe set `name` to a value other than its default: the checks refuse
        keys a path ignores only then, so a recipe may still write the default out."""
        default = type(self).model_fields[name].get_default(call_default_factory=True)
        return getattr(self, name) != default


class ModelConfig(_Section):
    """Which model to train."""

    path: str = Field(
        description="Local folder of the model (diffusers `model_index.json` or HF `config.json`)."
    )
    tiny: str | None = Field(
        None,
        description="Tiny-model family (e.g. `sd3`). If set and `path` does not exist, an "
        "architecture-faithful tiny random model is built there with `omni_adapters.tiny.build`.",
    )
    tiny_seed: int = Field(0, description="Seed of the tiny random model build.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights dtype of the trainable model."
    )
    device: str = Field("cpu", description="Torch device, e.g. `cpu` or `cuda`.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for `from_pretrained`."
    )

    @field_validator("path")
    @classmethod
    def _expand(cls, v: str) -> str:
        return os.path.expanduser(os.path.expandvars(v))


class LoraConfig(_Section):
    """LoRA adapters on the transformer's attention projections."""

    enabled: bool = Field(True, description="Train LoRA adapters (false: full fine-tuning).")
    rank: int = Field(8, ge=1, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scale = alpha / rank).")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] | None = Field(
        None, description="Module names to wrap; null = the adapter's attention projections."
    )
    full_regex: str | None = Field(
        None,
        description="With `enabled: false`: only parameters whose full name matches this "
        "regex train (e.g. BAGEL's generation expert `.*_moe_gen.*`); null = every parameter "
        "of the trainable component.",
    )

    @field_validator("full_regex")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
        return v

    init_seed: int = Field(
        0, description="Seed for the LoRA A matrices' random init (B starts at zero)."
    )


class DataConfig(_Section):
    """Prompt source. Either an inline list or a data file (JSONL / Parquet / .txt)."""

    prompts: list[str] | None = Field(None, description="Inline training prompts.")
    file: str | None = Field(
        None,
        description="Training rows: JSONL (`prompt`, optional `image`: a PNG/JPEG path "
        "relative to the file, the source image of an image-editing model), `.parquet` "
        "(columns `prompt`, optional `image` as path or bytes; needs `omni-train[parquet]`) "
        "or `.txt` (one prompt per line). See omni_train.data.",
    )
    prompts_per_step: int = Field(
        4, ge=1, description="Distinct prompts per step (each repeated `rollout.n` times)."
    )
    shuffle: bool = Field(True, description="Shuffle prompt order each epoch (seeded).")
    val_prompts: list[str] | None = Field(
        None,
        description="Held-out validation prompts, inline (diffusion path). Default: "
        "`data.val_file`; without either, validation uses the first training prompts and says "
        "they are not held out.",
    )
    task: str | None = Field(
        None,
        description="Omni path: a generated visual task (`shapes`: count 1-4 shapes, answer "
        "A-D) instead of `prompts`/`file`; see omni_train.tasks.",
    )
    task_options: dict[str, Any] = Field(
        default_factory=dict, description="Omni path: options of the generated task."
    )
    task_size: int = Field(256, ge=1, description="Omni path: generated training items.")
    val_size: int = Field(
        32, ge=1, description="Omni path: held-out validation items (generated task)."
    )
    val_file: str | None = Field(
        None,
        description="Held-out validation rows, in `data.file`'s formats: diffusion prompts "
        "(with the source image of an image-editing model), or omni rows (`prompt`, `answer`, "
        "`image`). `omni-train prepare` writes one (test.jsonl) next to each training file. "
        "Default (omni path): a generated task's held-out split, or the first `val_size` rows.",
    )


class RolloutConfig(_Section):
    """Sampling settings for the rollout engine."""

    backend: Literal["embedded", "http", "vllm-omni"] = Field(
        "embedded",
        description="Rollout engine: `embedded` (diffusion_rollout.EmbeddedEngine in the "
        "trainer, or in Ray rollout workers), `http` (a `diffusion-rollout serve` at "
        "`rollout.url`, token in DIFFUSION_ROLLOUT_TOKEN) or `vllm-omni` (vllm-omni's "
        "AsyncOmni; a GPU). Diffusion models only.",
    )
    url: str | None = Field(
        None,
        description="http: the rollout server's base URL; null = omni-train starts "
        "`diffusion-rollout serve` for the recipe's model (its model.device, dtype and options) "
        "on a free loopback port and stops it with the run. A server of your own may outlive a "
        "run: a resumed run continues on it; a new run needs one nobody has pushed weights to.",
    )
    n: int = Field(8, ge=2, description="Samples per prompt (the GRPO group size).")
    max_num_seqs: int = Field(16, ge=1, description="Max rows packed into one forward.")
    height: int = Field(64, ge=8, description="Image height in pixels.")
    width: int = Field(64, ge=8, description="Image width in pixels.")
    num_frames: int = Field(1, ge=1, description="Frames (video models).")
    num_steps: int = Field(10, ge=1, description="Denoising steps.")
    guidance_scale: float = Field(1.0, ge=0, description="CFG scale (1 = off).")
    true_cfg_scale: float = Field(1.0, ge=0, description="True CFG with negative prompt (1 = off).")
    noise_level: float = Field(0.7, ge=0, description="SDE noise level a (Flow-GRPO).")
    sde_kind: Literal["sde", "cps", "dance", "ode"] = Field(
        "sde", description="Stochastic step formula inside the SDE window."
    )
    sde_window_size: int = Field(
        2, ge=1, description="Number of SDE (stochastic, trained) steps per trajectory."
    )
    sde_window_range: tuple[int, int] = Field(
        (0, 5),
        description="[low, high): steps the SDE window lies in (its start is drawn uniformly).",
    )
    max_new_tokens: int = Field(
        256, ge=1, description="Omni path: max generated tokens per response."
    )
    temperature: float = Field(1.0, gt=0, description="Omni path: sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Omni path: nucleus (top-p) sampling.")
    val_temperature: float = Field(
        0.0, ge=0, description="Omni path: validation temperature (0 = greedy)."
    )
    allowed_tokens: list[str] | None = Field(
        None,
        description="Omni path: constrained decoding. Rollout, validation and the trainer's "
        "replay mask every token outside the union of these strings' tokens (plus EOS) to "
        "-inf before the softmax, so the policy trained is that renormalised distribution "
        "(e.g. `[A, B, C, D]` for choice letters). null or [] = unconstrained.",
    )


class RewardTerm(_Section):
    name: str = Field(description="Registered reward name.")
    weight: float = Field(1.0, description="Weight in the sum.")
    options: dict[str, Any] = Field(default_factory=dict, description="Reward options.")


class LatentDistillConfig(_Section):
    """Fit the `latent` reward's scorer from this model's rollouts (omni_train.latent_scorer)."""

    teacher: str = Field("brightness", description="Image reward the scorer learns to imitate.")
    teacher_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options for the teacher reward."
    )
    samples: int = Field(256, ge=10, description="Rollouts (latent, decoded image) to fit on.")
    steps: int = Field(300, ge=1, description="Scorer optimisation steps.")
    batch_size: int | None = Field(
        None,
        ge=2,
        description="Pairs each scorer step fits (a random minibatch); null = all of them.",
    )
    seed: int = Field(
        0,
        description="Seed of the scorer's rollouts and fit. The scorer is the run's reward "
        "model, so it does not follow `trainer.seed`: runs at other seeds reuse it.",
    )


class RewardConfig(_Section):
    """The reward. Either one `name` (+ `options`) or several weighted `terms`."""

    name: str | None = Field(None, description="Registered reward name (see omni_rewards).")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options for `load_reward`."
    )
    terms: list[RewardTerm] | None = Field(
        None, description="Several rewards combined by weight (instead of `name`)."
    )
    inputs: list[Literal["media", "latents", "audio"]] = Field(
        ["media"],
        description="Diffusion path: what the reward is given: `media` (decoded images or "
        "videos), `latents` (the clean final latents; without `media` the training rollout "
        "skips the VAE decode), `audio` (the waveform of a video+audio model, with its "
        "sample rate).",
    )
    distill: LatentDistillConfig | None = Field(
        None,
        description="`name: latent` only: when `options.path` holds no scorer, fit one there "
        "first, on rollouts of this model scored by `distill.teacher`.",
    )
    overlap: bool | Literal["auto"] = Field(
        "auto",
        description="Diffusion path, trainer.mode sync, local backend, embedded rollout (`true` "
        "elsewhere is refused): score each wave's "
        "samples in a reward thread as soon as the wave finishes, while the next waves compute "
        "(the reward time hides behind the rollout's). `auto`: on where the rollout runs on a "
        "GPU; on the CPU only for an `http` reward while the rollout's torch threads leave a "
        "core free: elsewhere on the CPU the reward thread slowed the rollout about as much "
        "as it hid, or more (docs/performance.md).",
    )
    extract: Literal["response", "first_letter"] = Field(
        "response",
        description="Omni path: what the reward reads: the whole response, or only its first "
        "free-standing choice letter (short multiple-choice answers).",
    )


class MixWindowConfig(_Section):
    """MixGRPO's sliding SDE window (`algorithm.name: mix_grpo`; Li et al. 2025, arXiv
    2507.21802): at training step s every sample's SDE (trained) window is
    ``[start, start + rollout.sde_window_size)`` with
    ``start = min(low + (s // shift_interval) * stride, high - size)`` inside
    `rollout.sde_window_range` = (low, high) (`omni_algos.sde.mix_grpo_window`); steps after
    the window are ODE steps taken ``ode_stride`` schedule steps at a time."""

    placement: Literal["progressive", "random"] = Field(
        "progressive",
        description="`progressive`: the sliding window; `random`: a window start drawn per "
        "training step, shared by the batch.",
    )
    shift_interval: int = Field(
        25, ge=1, description="Training steps between two moves of the window."
    )
    stride: int = Field(1, ge=0, description="Denoising steps the window moves each time.")
    ode_stride: int = Field(
        2,
        ge=1,
        description="After the window, each ODE step jumps this many schedule steps with a "
        "second-order solver (DPM-Solver++(2M)), as MixGRPO-Flash does (1 = plain Euler on "
        "every step).",
    )


class AlgorithmConfig(_Section):
    """The RL objective."""

    name: str = Field(
        "flow_grpo",
        description="An algorithm of `omni_train.algorithms.ALGORITHMS`: flow_grpo, "
        "dance_grpo, mix_grpo, flow_dppo, grpo_guard, diffusion_nft, diffusion_dpo (diffusion); "
        "gspo, grpo (omni).",
    )
    clip_range: float | None = Field(
        None,
        gt=0,
        description="PPO ratio clip epsilon, both sides. Default (null): the loss's own "
        "(flow_grpo, dance_grpo, mix_grpo, grpo_guard 1e-4; grpo 0.2; gspo 3e-4 below and "
        "4e-4 above). For grpo and gspo it sets the loss's clip_low and clip_high on every "
        "backend (`algorithm.options.clip_low` / `clip_high` set one side). flow_dppo, "
        "diffusion_nft and diffusion_dpo have no ratio clip: refused there.",
    )
    adv_clip_max: float = Field(5.0, gt=0, description="Advantages are clipped to +-this.")
    adv_std: Literal["global", "group", "none"] = Field(
        "group", description="Advantage normalisation: batch std, per-group std, or none."
    )
    num_minibatches: int = Field(
        1, ge=1, description="Optimizer steps per rollout batch (the batch is split)."
    )
    epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    kl_beta: float = Field(
        0.0,
        ge=0,
        description="KL to the reference (the base model, LoRA off) coefficient; 0 = off.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for the loss."
    )
    rows_per_forward: int | Literal["auto"] | None = Field(
        None,
        description="The most rows one forward pass of the update takes (memory): a minibatch "
        "is split into micro-batches whose gradients add up to the same optimizer step, and "
        "several SDE window steps (or noise draws) of a micro-batch replay in one forward, "
        "each row at its own timestep; of the splits with at most this many rows per forward "
        "the one with the fewest forwards runs. null = `rollout.max_num_seqs`; `auto` = as "
        "many as the free memory holds (on a CPU at most 1 GiB of activations and 128 rows), "
        "measured after the first update "
        "(`omni_train.updates.auto_rows`; local and ray backends; not bit-for-bit "
        "repeatable, as `trainer.threads: auto`).",
    )
    mix_window: MixWindowConfig = Field(
        default_factory=MixWindowConfig, description="mix_grpo: the sliding SDE window."
    )
    rollout_correction: Literal["off", "decoupled", "bypass"] = Field(
        "off",
        description="Rollout vs trainer log-prob mismatch (a bf16 or external rollout "
        "engine): `decoupled` recomputes the trainer's log-probs as the PPO anchor and weights "
        "by truncated IS; `bypass` keeps the rollout's and only rejects outliers.",
    )
    train_timesteps: int = Field(
        2,
        ge=1,
        description="diffusion_nft / diffusion_dpo: noised copies (t, eps draws) of each clean "
        "sample per pass.",
    )
    timestep_range: tuple[float, float] = Field(
        (0.0, 1.0),
        description="diffusion_nft / diffusion_dpo: [lo, hi] the training t is drawn from "
        "uniformly (x_t = (1 - t) x0 + t eps).",
    )

    timestep_sampling: Literal["uniform", "schedule"] = Field(
        "uniform",
        description="diffusion_nft / diffusion_dpo: `uniform`: t ~ U[timestep_range]; "
        "`schedule`: t is one of the rollout schedule's sigmas (rollout.num_steps steps, the "
        "model's shift included) in timestep_range, each equally likely, as DiffusionNFT's "
        "official trainer re-noises at the sampler's timesteps.",
    )

    reuse_rollout_forward: bool | Literal["auto"] = Field(
        "auto",
        description="SDE replay algorithms (flow_grpo, dance_grpo, mix_grpo): the update "
        "back-propagates through the rollout's own forwards of the trained SDE steps instead "
        "of recomputing them, the same gradient with one forward per trained step fewer "
        "(`omni_train.updates.replay`). Those forwards then run on the learner's unmerged "
        "weights with autograd (the other rollout forwards stay on the merged copy) and keep "
        "their activations until the update: the memory of a replay of the whole batch in one "
        "micro-batch, checked at the rollout's first forward with autograd against half the "
        "free memory (0.6 on CUDA; `omni_train.updates.reuse_memory`). It needs one optimizer "
        "step on the rollout's own weights: num_minibatches 1, epochs 1, kl_beta 0, "
        "rollout_correction off, rows_per_forward null; trainer.backend local, trainer.mode "
        "sync, rollout.backend embedded. `true`: a recipe that does not meet these is refused "
        "and a batch that does not fit stops the run; `auto`: on when the recipe meets them, "
        "and a batch that does not fit falls back to the replay for the rest of the run "
        "(logged); `false`: always replay.",
    )

    pairs_per_group: int = Field(
        1,
        ge=1,
        description="diffusion_dpo: preference pairs per prompt group, the i-th best sample "
        "against the i-th worst (`omni_algos.losses.pair_by_reward`; at most half the group; "
        "1 = best vs worst).",
    )

    @field_validator("rows_per_forward")
    @classmethod
    def _rows_positive(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be >= 1, `auto` or null, got {v}")
        return v

    @field_validator("timestep_range")
    @classmethod
    def _t_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 <= v[0] < v[1] <= 1.0:
            raise ValueError(f"needs 0 <= lo < hi <= 1, got {list(v)}")
        return v


class SchedulerConfig(_Section):
    """The learning-rate schedule over `trainer.steps` (a function of the step alone, so a
    resumed run continues it exactly; `omni_train.lr_schedule`)."""

    name: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="After warmup: constant, linear decay, or cosine decay."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Training steps of linear warmup from 0 to `optimizer.lr`."
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="linear / cosine: the learning rate at the last step, as a "
        "fraction of `optimizer.lr`.",
    )


class OptimizerConfig(_Section):
    """AdamW on the trainable parameters."""

    name: Literal["adamw"] = Field("adamw", description="Optimizer.")
    lr: float = Field(3e-4, gt=0, description="Learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(1e-4, ge=0, description="Decoupled weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig, description="The learning-rate schedule."
    )
    ema_decay: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="EMA of the LoRA weights, `ema <- d ema + (1 - d) w` after each optimizer "
        "step (0 = off); validation then samples with the EMA weights.",
    )


class ResourcePool(_Section):
    """One role's workers under `trainer.backend: ray` (see docs/scaling.md)."""

    workers: int = Field(1, ge=1, description="Ray actors for this role.")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs each actor reserves (0 on CPU).")
    cpus_per_worker: float = Field(0.0, ge=0, description="CPUs each actor reserves.")


class TrainerConfig(_Section):
    """The outer loop, logging and checkpoints."""

    backend: Literal["local", "ray", "verl"] = Field(
        "local", description="Where the loop runs: one process, Ray actors + FSDP2, or verl."
    )
    num_workers: int = Field(
        1, ge=1, description="ray: actor (FSDP2) workers; also the default rollout workers."
    )
    nnodes: int = Field(1, ge=1, description="ray/verl: nodes in the cluster.")
    gpus_per_node: int = Field(0, ge=0, description="ray/verl: GPUs per node (0 = CPU, gloo).")
    resource_pools: dict[Literal["actor", "rollout", "reward"], ResourcePool] = Field(
        default_factory=dict,
        description="ray: per-role workers/GPUs (default: actor and rollout = num_workers, "
        "reward = 1).",
    )
    mode: Literal["sync", "async"] = Field(
        "sync", description="async: the rollout of step k+1 overlaps the update of step k."
    )
    max_staleness: int = Field(
        1, ge=0, description="async: max policy versions between a sample's rollout and update."
    )
    async_correction: Literal["decoupled", "bypass"] = Field(
        "decoupled", description="async: rollout_correction mode for off-policy samples."
    )
    max_restarts: int = Field(
        3, ge=0, description="ray: restarts of a dead rollout/reward worker within one step."
    )
    verl: dict[str, Any] = Field(
        default_factory=dict, description="verl: extra dotted config overrides, passed as is."
    )
    steps: int = Field(20, ge=1, description="Training steps (one rollout batch each).")
    seed: int = Field(0, ge=0, description="Run seed: data order and every sample's seed.")
    output_dir: str | None = Field(
        None,
        description="Run folder (default: runs/<experiment>). A folder that already holds a "
        "run of the same recipe is resumed from its latest checkpoint; one of another recipe is "
        "refused (see `overwrite`).",
    )
    overwrite: bool = Field(
        False,
        description="Start over in `output_dir` even when it holds a run (its metrics, samples "
        "and checkpoints are deleted first).",
    )
    log_every: int = Field(1, ge=1, description="Console line every N steps.")
    sample_every: int = Field(5, ge=0, description="Sample grid PNG every N steps (0 = off).")
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps (0 = only at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    val_every: int = Field(0, ge=0, description="Validation every N steps (0 = off).")
    val_num_steps: int | None = Field(
        None, ge=1, description="Denoising steps for validation (default: rollout.num_steps)."
    )
    val_samples_per_prompt: int = Field(2, ge=1, description="Validation images per prompt.")
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="Trackers the metrics and sample grids also go to (metrics.jsonl is always "
        "written): `tensorboard` (extra `tensorboard`, `<output>/tensorboard`), `wandb` (extra "
        "`wandb`; `WANDB_MODE=offline` works without a network; the run is `<output>/wandb`, "
        "a resumed run continues it).",
    )
    wandb_project: str = Field("omni-rl", description="wandb project name.")
    progress: bool = Field(True, description="Show a tqdm progress bar.")
    threads: int | Literal["auto"] | None = Field(
        None,
        description="torch.set_num_threads (CPU). null: torch's default. `auto` (local "
        "backend, sync mode, CPU): before each step, the cores other processes leave free "
        "(docs/performance.md); faster on a loaded machine, but the thread count then follows "
        "the load, so float results are no longer bit-for-bit repeatable.",
    )

    @field_validator("threads")
    @classmethod
    def _threads_positive(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be >= 1 or `auto`, got {v}")
        return v

    @field_validator("output_dir")
    @classmethod
    def _expand(cls, v: str | None) -> str | None:
        return None if v is None else os.path.expanduser(os.path.expandvars(v))


class Recipe(_Section):
    """A whole training run."""

    experiment: str = Field("run", description="Run name; the default output is runs/<name>.")
    model: ModelConfig
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)

    def is_omni(self) -> bool:
        """The autoregressive (omni thinker) path: `model.tiny: qwen3_omni_thinker` or an
        omni algorithm (gspo, grpo); it runs `omni_train.loops.OmniLoop`."""
        row = ALGORITHMS.get(self.algorithm.name)
        return self.model.tiny in OMNI_FAMILIES or (row is not None and row.model == "omni")

    def reuses_rollout_forward(self) -> bool:
        """Whether the update back-propagates through the rollout's forwards: `true`, or
        `auto` on a recipe that `true` would admit (`algorithm.reuse_rollout_forward`)."""
        choice = self.algorithm.reuse_rollout_forward
        if choice != "auto":
            return bool(choice)
        row = ALGORITHMS.get(self.algorithm.name)
        return row is not None and not self._reuse_rollout_forward_problems(row)

    def output_dir(self) -> Path:
        """The run folder: `trainer.output_dir` or `runs/<experiment>`."""
        return Path(self.trainer.output_dir or os.path.join("runs", self.experiment))

    def sampling_params(self, **changes: Any) -> Any:
        """The rollout's `diffusion_rollout.SamplingParams` (validated there)."""
        from diffusion_rollout import SamplingParams

        r = self.rollout
        fields = dict(
            height=r.height,
            width=r.width,
            num_frames=r.num_frames,
            num_steps=r.num_steps,
            guidance_scale=r.guidance_scale,
            true_cfg_scale=r.true_cfg_scale,
            noise_level=r.noise_level,
            sde_kind=r.sde_kind,
            sde_window_size=r.sde_window_size,
            sde_window_range=tuple(r.sde_window_range),
            output="both",
        )
        fields.update(changes)
        return SamplingParams(**fields)

    def check(self) -> None:
        """Cross-field checks that pydantic's per-field types cannot express. What the
        algorithm table (`omni_train.algorithms`) says a backend or mode does not run is
        refused here, by key, so a recipe that validates runs."""
        problems: list[str] = []
        a, t = self.algorithm, self.trainer
        if (self.reward.name is None) == (self.reward.terms is None):
            problems.append("reward: set exactly one of `reward.name` or `reward.terms`")
        sources = [k for k in ("prompts", "file", "task") if getattr(self.data, k) is not None]
        if not sources:
            problems.append(
                "data: set `data.prompts` (a list), `data.file` (a JSONL path) or `data.task`"
            )
        if len(sources) > 1:
            problems.append(f"data: set only one of {', '.join('data.' + k for k in sources)}")
        if self.data.val_prompts is not None and self.data.val_file is not None:
            problems.append("data: set only one of data.val_prompts, data.val_file")
        if self.data.val_prompts is not None and self.is_omni():
            problems.append(
                "data.val_prompts: the omni path validates on items with reference answers: "
                "data.val_file, or the held-out items of data.task"
            )
        if self.reward.terms and self.reward.options:
            problems.append(
                "reward.options: with reward.terms each term has its own options "
                "(reward.terms[i].options)"
            )
        row = ALGORITHMS.get(a.name)
        if row is None:
            problems.append(unknown_name("algorithm.name", "algorithm", a.name, ALGORITHMS))
        else:
            problems.extend(self._algorithm_problems(row))
        on_cpu = self.model.device == "cpu"
        if t.threads == "auto" and (
            t.backend != "local" or t.mode != "sync" or self.is_omni() or not on_cpu
        ):
            problems.append(
                "trainer.threads: `auto` follows the load on the local backend in sync mode "
                f"for diffusion models on a CPU; this recipe has backend {t.backend}, mode "
                f"{t.mode}, model.device {self.model.device}"
                + (", an omni model" if self.is_omni() else "")
                + ": give a number or null"
            )
        if self.reward.distill is not None and self.reward.name != "latent":
            problems.append("reward.distill: only for `reward.name: latent`")
        if not self.reward.inputs or len(set(self.reward.inputs)) != len(self.reward.inputs):
            problems.append(
                f"reward.inputs: a non-empty list without repeats, got {self.reward.inputs}"
            )
        rb = self.rollout.backend
        if rb != "embedded":
            if self.is_omni():
                problems.append(
                    f"rollout.backend: {rb} serves diffusion models; the omni path samples "
                    "with rollout.backend embedded"
                )
            if "audio" in self.reward.inputs:
                problems.append(
                    f"reward.inputs: audio is decoded next to the trainer (rollout.backend "
                    f"embedded), not by a {rb} rollout"
                )
            if rb == "vllm-omni" and not self.model.device.startswith("cuda"):
                problems.append(
                    "rollout.backend: vllm-omni runs on a GPU (model.device cuda); on CPU use "
                    "embedded or http"
                )
            if "rollout" in t.resource_pools:
                problems.append(
                    f"trainer.resource_pools.rollout: with rollout.backend {rb} no rollout pool "
                    "starts on Ray (the server or vllm-omni samples); drop it"
                )
        elif self.rollout.url is not None:
            problems.append("rollout.url: only for rollout.backend http")
        if self.reward.overlap is True:
            problems.extend(self._overlap_problems())
        problems.extend(self._other_path_problems())
        if "audio" in self.reward.inputs and t.backend != "local":
            problems.append(
                "reward.inputs: audio is decoded by the local backend only (trainer.backend "
                f"{t.backend} would not give the reward a waveform); use trainer.backend local"
            )
        if self.optimizer.ema_decay > 0:
            if not self.lora.enabled:
                problems.append("optimizer.ema_decay > 0 needs lora.enabled (EMA of the LoRA)")
            if t.backend != "local" or t.mode != "sync":
                problems.append(
                    "optimizer.ema_decay: EMA weights run with trainer.backend local and "
                    "trainer.mode sync (the EMA lives on the trainer's module)"
                )
            if rb != "embedded":
                problems.append(
                    f"optimizer.ema_decay: validation samples the EMA weights on the trainer's "
                    f"own module; a {rb} rollout holds the pushed live weights, so it would "
                    "validate those instead: use rollout.backend embedded"
                )
        if a.kl_beta > 0 and not self.lora.enabled:
            problems.append(
                "algorithm.kl_beta > 0 needs lora.enabled: the KL reference is the base model "
                "with the LoRA adapters disabled"
            )
        if self.data.task is not None and not self.is_omni():
            problems.append(
                "data.task: generated tasks are for the omni path (algorithm gspo/grpo)"
            )
        if self.data.prompts is not None and len(self.data.prompts) == 0:
            problems.append("data.prompts: the prompt list is empty")
        try:
            self.sampling_params()
        except ValueError as exc:
            msg = str(exc).replace("SamplingParams.", "rollout.")
            problems.append(msg)
        batch = self.data.prompts_per_step * self.rollout.n
        if batch % a.num_minibatches:
            problems.append(
                f"algorithm.num_minibatches: {a.num_minibatches} does not divide "
                f"the batch of data.prompts_per_step * rollout.n = {batch}"
            )
        if problems:
            raise RecipeError("invalid recipe:\n  " + "\n  ".join(problems))

    def _other_path_problems(self) -> list[str]:
        """Keys of the other loop (`DIFFUSION_ONLY_KEYS`, `OMNI_ONLY_KEYS`) set to other than
        their defaults: a diffusion model decodes no tokens, an omni model samples no images."""
        if self.is_omni():
            keys, this, reader = DIFFUSION_ONLY_KEYS, "an omni model", "the diffusion loop"
        else:
            keys, this, reader = OMNI_ONLY_KEYS, "a diffusion model", "the omni (token) loop"
        out = []
        for section, names in keys.items():
            for name in names:
                if getattr(self, section).differs_from_default(name):
                    out.append(
                        f"{section}.{name}: only {reader} reads it and this recipe trains {this}; "
                        "drop the key"
                    )
        return out

    def _overlap_problems(self) -> list[str]:
        """Where `reward.overlap: true` could not run: only the embedded engine of a sync run
        on the local backend hands the loop its waves as they finish, and only the diffusion
        loop scores them (`omni_train.loops.diffusion.reward_overlaps`); `auto` and false run
        everywhere."""
        t, rb = self.trainer, self.rollout.backend
        where = []
        if self.is_omni():
            where.append("an omni model (the omni loop scores after its rollout)")
        if t.mode != "sync":
            where.append(f"trainer.mode {t.mode} (the rollout runs ahead, beside the update)")
        if t.backend != "local":
            where.append(f"trainer.backend {t.backend} (its rollout returns whole batches)")
        if rb != "embedded":
            where.append(f"rollout.backend {rb} (it returns whole batches)")
        if "audio" in self.reward.inputs:
            where.append("audio in reward.inputs (decoded from the whole batch)")
        if not where:
            return []
        return [
            "reward.overlap: true scores the waves of the embedded rollout of a sync diffusion "
            f"run on the local backend; this recipe has {'; '.join(where)}: use `auto` or false"
        ]

    def _algorithm_problems(self, row: Any) -> list[str]:
        """What the algorithm's table row says this recipe cannot run."""
        out = []
        a, t = self.algorithm, self.trainer
        tiny = self.model.tiny
        if tiny in OMNI_FAMILIES and row.model != "omni":
            out.append(
                f"algorithm.name: the omni path (model.tiny {tiny}) trains with a "
                f"token algorithm (gspo, grpo); got {a.name!r}"
            )
        if tiny is not None and tiny not in OMNI_FAMILIES and row.model == "omni":
            out.append(
                f"algorithm.name: {a.name} trains autoregressive (omni) models; model.tiny "
                f"{tiny} is a diffusion model (use flow_grpo, diffusion_nft, ...)"
            )
        if row.model == "omni" and self.data.prompts is not None:
            out.append(
                "data.prompts: the omni path needs reference answers; use `data.file` (JSONL "
                "rows with prompt, answer, image) or `data.task`"
            )
        if t.backend not in row.backends:
            out.append(
                f"trainer.backend: {a.name} runs on {', '.join(row.backends)}, not {t.backend!r}"
            )
        if t.mode not in row.modes:
            out.append(
                f"trainer.mode: {a.name} runs in mode {', '.join(row.modes)}, not {t.mode!r}"
            )
        if row.kind == "sde_replay" and self.rollout.sde_kind not in row.sde_kinds:
            out.append(
                f"rollout.sde_kind: {a.name} is defined for the SDE kinds "
                f"{', '.join(row.sde_kinds)}, got {self.rollout.sde_kind!r}"
            )
        if a.timestep_sampling != "uniform" and row.kind != "forward_process":
            out.append(
                f"algorithm.timestep_sampling: {a.name} trains on its rollout's own steps; "
                "the re-noising t is for diffusion_nft and diffusion_dpo"
            )
        if row.kind != "forward_process":
            for key in ("train_timesteps", "timestep_range"):
                if a.differs_from_default(key):
                    out.append(
                        f"algorithm.{key}: {a.name} trains on its rollout's own steps; the "
                        "re-noising t is for diffusion_nft and diffusion_dpo"
                    )
        if row.pairs:
            for key in ("adv_std", "adv_clip_max"):
                if a.differs_from_default(key):
                    out.append(
                        f"algorithm.{key}: {a.name} trains on the best and worst sample of "
                        "each group, not on advantages (drop the key)"
                    )
        if a.pairs_per_group != 1 and not row.pairs:
            out.append(
                f"algorithm.pairs_per_group: {a.name} trains on every sample, not on "
                "preference pairs (diffusion_dpo)"
            )
        if row.window != "mix_grpo" and a.mix_window != MixWindowConfig():
            out.append(
                f"algorithm.mix_window: only mix_grpo slides an SDE window; {a.name} would "
                "ignore it (drop the section, or keep its defaults)"
            )
        if a.clip_range is not None and "clip_range" not in row.loss_inputs:
            out.append(f"algorithm.clip_range: {a.name}'s loss has no ratio clip (drop the key)")
        if a.rollout_correction != "off" and not row.takes_weights:
            out.append(f"algorithm.rollout_correction: {a.name}'s loss takes no per-sample weights")
        if row.kind == "forward_process" and a.name == "diffusion_dpo" and not self.lora.enabled:
            out.append(
                "algorithm.name: diffusion_dpo needs lora.enabled (its reference is the base "
                "model with the LoRA off)"
            )
        if row.kind == "forward_process" and a.kl_beta > 0:
            out.append(
                f"algorithm.kl_beta: {a.name} has its own reference term "
                "(diffusion_nft: algorithm.options.kl_weight; diffusion_dpo: options.beta)"
            )
        if a.reuse_rollout_forward is True:
            out.extend(self._reuse_rollout_forward_problems(row))
        if t.backend == "verl":
            out.extend(self._verl_problems())
        return out

    def _verl_problems(self) -> list[str]:
        """What `trainer.backend: verl` cannot hand to verl 0.9 (omni_train.backends.
        verl_backend.build_verl_config maps the rest): refused by key rather than ignored."""
        a, o, d = self.algorithm, self.optimizer, self.data
        out = []
        if a.rows_per_forward is not None:
            out.append(
                "algorithm.rows_per_forward: sizes the local and ray backends' forwards; verl "
                "sizes its own micro-batches (its actor.use_dynamic_bsz or "
                "ppo_micro_batch_size_per_gpu, through trainer.verl): set it null"
            )
        if a.adv_std == "global":
            out.append(
                "algorithm.adv_std: verl's advantage estimators divide by each group's std or "
                "by none (its algorithm.norm_adv_by_std_in_grpo); use group or none, or "
                "trainer.backend local or ray for global"
            )
        if self.rollout.allowed_tokens:
            out.append(
                "rollout.allowed_tokens: verl's rollout engines sample without a token mask; "
                "use trainer.backend local or ray"
            )
        if self.reward.name is None:
            out.append("reward.terms: backend verl takes one named reward (reward.name)")
        if d.prompts is not None:
            out.append(
                "data.prompts: the omni path needs reference answers; use `data.file` (JSONL "
                "rows with prompt, answer, image) or `data.task`"
            )
        elif d.task is None and d.file is None:
            out.append("data.task / data.file: backend verl needs one of them")
        if o.scheduler.name != "constant" or o.scheduler.warmup_steps:
            out.append(
                "optimizer.scheduler: not handed to verl; set verl's own schedule through "
                "trainer.verl (actor_rollout_ref.actor.optim.lr_scheduler_type, "
                "lr_warmup_steps) and keep the scheduler constant without warmup here"
            )
        if o.differs_from_default("eps"):
            out.append(
                "optimizer.eps: not handed to verl; set it through trainer.verl "
                "(actor_rollout_ref.actor.optim.override_optimizer_config)"
            )
        if not self.lora.enabled and self.lora.full_regex is not None:
            out.append(
                "lora.full_regex: verl trains every weight of the actor without LoRA; it "
                "cannot train a subset"
            )
        for key in ("dropout", "init_seed"):
            if self.lora.enabled and self.lora.differs_from_default(key):
                out.append(f"lora.{key}: verl's LoRA config has no such setting; keep the default")
        if "clip_ratio_c" in a.options and a.options["clip_ratio_c"] is None:
            out.append(
                "algorithm.options.clip_ratio_c: null (no dual clip) is not handed to verl, "
                "whose actor always bounds negative advantages by its clip_ratio_c; give a "
                "number > 1"
            )
        return out

    def _reuse_rollout_forward_problems(self, row: Any) -> list[str]:
        """`algorithm.reuse_rollout_forward` gives the replay's gradient only when the update
        is one optimizer step on the rollout's own weights, in the process that rolled out,
        with a loss that reads nothing but the log-probs."""
        a, t = self.algorithm, self.trainer
        key = "algorithm.reuse_rollout_forward"
        if row.kind != "sde_replay" or {"mean", "std", "std_mean"} & set(row.loss_inputs):
            return [
                f"{key}: {a.name} does not train on the rollout's log-probs alone; it is for "
                "flow_grpo, dance_grpo and mix_grpo"
            ]
        out = []
        if a.num_minibatches != 1 or a.epochs != 1:
            out.append(
                f"{key}: needs one optimizer step per rollout (algorithm.num_minibatches 1 and "
                f"epochs 1, got {a.num_minibatches} and {a.epochs}): later steps train on "
                "weights the rollout did not run"
            )
        if a.kl_beta > 0:
            out.append(f"{key}: algorithm.kl_beta > 0 replays the reference; set kl_beta 0")
        if a.rollout_correction != "off":
            out.append(
                f"{key}: algorithm.rollout_correction {a.rollout_correction} corrects another "
                "engine's log-probs; the rollout is the learner's own here (set it off)"
            )
        if a.rows_per_forward is not None:
            out.append(
                f"{key}: algorithm.rows_per_forward does not apply (the update runs no forward "
                "of its own; the rollout's waves hold rollout.max_num_seqs rows): set it null"
            )
        if t.backend != "local" or t.mode != "sync" or self.rollout.backend != "embedded":
            out.append(
                f"{key}: needs trainer.backend local, trainer.mode sync and rollout.backend "
                f"embedded (the rollout runs in the learner's process on the learner's "
                f"weights); got {t.backend}, {t.mode}, {self.rollout.backend}"
            )
        return out


# ---------------------------------------------------------------------------------------------
# Loading, overrides and readable errors


def _model_for(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the field at `loc` (a path of field names)."""
    model: type[BaseModel] = Recipe
    for part in loc:
        if not isinstance(part, str):
            continue  # list index
        field = model.model_fields.get(part)
        if field is None:
            return None
        sub = _submodel(field.annotation)
        if sub is None:
            return None
        model = sub
    return model


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        sub = _submodel(arg)
        if sub is not None:
            return sub
    return None


def valid_keys(model: type[BaseModel] = Recipe, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, e.g. `rollout.n`, `reward.terms.name`."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        dotted = prefix + name
        keys.append(dotted)
        sub = _submodel(field.annotation)
        if sub is not None:
            keys.extend(valid_keys(sub, dotted + "."))
    return keys


def suggest(loc: tuple[Any, ...]) -> str | None:
    """The closest valid dotted key to an unknown key at `loc`."""
    names = [p for p in loc if isinstance(p, str)]
    if not names:
        return None
    owner = _model_for(tuple(loc[:-1]))
    prefix = ".".join(names[:-1])
    if owner is not None:
        close = difflib.get_close_matches(names[-1], list(owner.model_fields), n=1, cutoff=0.6)
        if close:
            return f"{prefix}.{close[0]}" if prefix else close[0]
    # the key may belong to another section (e.g. `trainer.lr` -> `optimizer.lr`)
    all_keys = valid_keys()
    leaf = names[-1]
    same_leaf = [k for k in all_keys if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return same_leaf[0]
    close = difflib.get_close_matches(".".join(names), all_keys, n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_name(key: str, kind: str, name: str, known: Any) -> str:
    """``"<key>: unknown <kind> 'x' (did you mean 'y'?); known: a, b"`` for a registry lookup."""
    names = sorted(str(k) for k in known)
    close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{key}: unknown {kind} {name!r}{hint}; known: {', '.join(names)}"


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def format_validation_error(err: ValidationError, source: str = "recipe") -> str:
    """One readable line per problem, each naming the dotted key."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = _fmt_loc(loc)
        if e["type"] == "extra_forbidden" and key in RENAMED_KEYS:
            msg = f"'{key}' was renamed: use {RENAMED_KEYS[key]}"
        elif e["type"] == "extra_forbidden":
            hint = suggest(loc)
            msg = f"unknown key '{key}'"
            if hint:
                msg += f" (did you mean '{hint}'?)"
        elif e["type"] == "missing":
            msg = f"missing required key '{key}'"
        else:
            got = e.get("input")
            got_s = repr(got)
            if len(got_s) > 60:
                got_s = got_s[:57] + "..."
            msg = f"'{key}': {e['msg']} (got {got_s})"
        lines.append(msg)
    head = f"invalid {source}:" if len(lines) > 1 else f"invalid {source}: "
    return head + ("\n  " + "\n  ".join(lines) if len(lines) > 1 else lines[0])


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], yaml-scalar(value))."""
    if "=" not in item:
        raise RecipeError(f"override '{item}' is not of the form key=value (e.g. trainer.steps=5)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override '{item}': empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise RecipeError(f"override '{item}': value is not valid YAML ({exc})") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted `key=value` in a nested dict (in place; also returned)."""
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise RecipeError(
                    f"override '{item}': '{where}' is a value ({child!r}), not a section"
                )
            node = child
        node[parts[-1]] = value
    return data


def recipe_from_dict(data: dict[str, Any], source: str = "recipe") -> Recipe:
    """Validate a nested dict into a `Recipe` (RecipeError with every problem on failure)."""
    if not isinstance(data, dict):
        raise RecipeError(f"invalid {source}: the top level must be a mapping of sections")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(format_validation_error(err, source)) from None
    recipe.check()
    return recipe


def load_recipe(path: str | os.PathLike[str], overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe, apply `key=value` overrides, validate."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {p} is not valid YAML: {exc}") from None
    apply_overrides(data, list(overrides or []))
    return recipe_from_dict(data, source=f"recipe {p}")


def dump_recipe(recipe: Recipe) -> str:
    """The fully resolved recipe as YAML (every default spelled out)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def _type_name(annotation: Any) -> str:
    import types
    import typing

    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in args)
    if typing.get_origin(annotation) is Literal and len(args) == 1:
        return f"`{args[0]}`"
    s = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    s = s or str(annotation).replace("typing.", "")
    return s.replace("NoneType", "null")


def reference_markdown() -> str:
    """The recipe reference (every key, its type, default and meaning) as Markdown tables.

    docs/recipes.md embeds this between `<!-- keys:start -->` and `<!-- keys:end -->`;
    regenerate with `python -m omni_train.recipe`.
    """
    import json as _json

    out: list[str] = []

    def table(model: type[BaseModel], prefix: str) -> None:
        # the docstring's first paragraph, whole (its first line alone can stop mid-sentence)
        doc = " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())
        out.append(f"### `{prefix.rstrip('.') or 'top level'}`\n")
        if doc:
            out.append(doc + "\n")
        out.append("| key | type | default | meaning |")
        out.append("| --- | --- | --- | --- |")
        subs = []
        for name, field in model.model_fields.items():
            sub = _submodel(field.annotation)
            if field.is_required():
                default = "required"
            elif sub is not None and field.default_factory is sub:
                default = "(section)"
            else:
                value = field.default_factory() if field.default_factory else field.default
                if isinstance(value, BaseModel):
                    value = value.model_dump(mode="json")
                default = f"`{_json.dumps(value)}`"
            if sub is not None:
                subs.append((sub, prefix + name + "."))
            typ = sub.__name__ if sub is not None else _type_name(field.annotation)
            if sub is not None and getattr(field.annotation, "__origin__", None) is dict:
                typ = f"mapping of name -> {sub.__name__} (keys below go under each name)"
            elif sub is not None and getattr(field.annotation, "__origin__", None) is None:
                args = [
                    getattr(a, "__origin__", None)
                    for a in getattr(field.annotation, "__args__", ())
                ]
                if list in args:
                    typ = f"list of {sub.__name__} (keys below go in each item)"
            typ = typ.replace("Literal[", "one of [").replace("dict[str, Any]", "mapping")
            desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
            out.append(
                f"| `{prefix}{name}` | {typ.replace('|', chr(92) + '|')} | {default} | {desc} |"
            )
        out.append("")
        for sub, p in subs:
            table(sub, p)

    table(Recipe, "")
    return "\n".join(out)


if __name__ == "__main__":  # print the key reference for docs/recipes.md
    print(reference_markdown())
