"""`trainer.backend: verl`: hand the omni (autoregressive) path to verl's PPO trainer.

verl pins an older transformers than this workspace, so it lives in its own environment
(`UV_PROJECT_ENVIRONMENT=.venv-verl uv sync --extra verl`, see docs/scaling.md). This module
imports verl only inside the functions that need it:

- `build_verl_config(recipe)`: a plain nested dict of verl's Hydra config (ppo_trainer)
  from our recipe; `to_overrides(config)` flattens it to `key=value` command-line overrides
  (`++key=value` for the keys verl's schema does not declare, `ADDED_KEYS`). Both are pure;
  the verl environment's test composes verl's own `ppo_trainer.yaml` with every override and
  runs verl's `validate_config` on the result (tests/test_verl_backend.py).
- `verl_policy_loss(name)`: our `omni_algos.losses` GRPO / GSPO in verl's policy-loss
  signature `(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
  rollout_is_weights) -> (loss, metrics)`; `omni_group_advantage`: our group-relative
  advantage in verl's estimator signature; `omni_compute_score`: our rewards in verl's
  `custom_reward_function` signature. All callable without verl.
- `register_into_verl()`: puts them into verl's registries (`register_policy_loss`,
  `register_adv_est` from `verl.trainer.ppo.core_algos`; the reward manager registry in
  `verl.workers.reward_manager`). verl's Ray workers import
  `actor_rollout_ref.model.external_lib`, which we point at `omni_train.backends.verl_register`
  so the registration also happens inside every worker process.
- `run_verl(recipe, run_dir)`: writes the dataset, exports the Qwen3-Omni thinker through our
  adapter (talker and code2wav stripped) and starts `python -m verl.trainer.main_ppo`.

The registry names (checked against verl's `core_algos.py`): policy losses `omni_grpo`,
`omni_gspo`; advantage estimator `omni_group`; reward manager `omni`.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..algorithms import ALGORITHMS
from ..errors import TrainError
from ..recipe import Recipe, RecipeError
from ..tasks import CHOICE_LETTERS, OmniItem, first_choice_letter, load_items
from ..updates.token import token_loss_options
from .ray_runtime import WORKER_RUNTIME_ENV

__all__ = [
    "ADDED_KEYS",
    "ADV_ESTIMATOR",
    "IMAGE_KEY",
    "LOSS_NAMES",
    "REWARD_FUNCTION_PATH",
    "build_verl_config",
    "global_batch_scale",
    "omni_compute_score",
    "omni_group_advantage",
    "omni_items",
    "register_into_verl",
    "run_verl",
    "to_overrides",
    "verl_available",
    "verl_policy_loss",
    "write_dataset",
]

#: our loss name -> the name it gets in verl's policy-loss registry
LOSS_NAMES = {"grpo": "omni_grpo", "gspo": "omni_gspo"}
ADV_ESTIMATOR = "omni_group"
#: where verl imports `omni_compute_score` from (`load_extern_object`'s package form: the file
#: form would load verl_backend.py outside its package, where its relative imports fail)
REWARD_FUNCTION_PATH = "pkg://omni_train.backends.verl_backend"
#: the parquet column verl's RLHFDataset reads images from (`data.image_key`, its default)
IMAGE_KEY = "images"
#: keys verl 0.9's config schema does not declare: set with Hydra's `++key=value`
ADDED_KEYS = (
    "algorithm.adv_clip_max",
    "reward.custom_reward_function.reward_kwargs",
    "ray_kwargs.ray_init.runtime_env.env_vars",
)
#: verl loss_agg_mode -> our `agg`
_AGG = {
    "token-mean": "token-mean",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "seq-mean-token-sum-norm",
}


def verl_available() -> bool:
    """True when verl can be imported (its own environment)."""
    try:
        import verl  # noqa: F401
    except Exception:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# config


def _set(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    node = cfg
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise RecipeError(f"trainer.verl: {dotted!r} goes through a value, not a section")
    node[parts[-1]] = value


def build_verl_config(
    recipe: Recipe,
    *,
    model_path: str | None = None,
    train_files: str | None = None,
    val_files: str | None = None,
    run_dir: str | Path | None = None,
) -> dict[str, Any]:
    """verl's PPO config (as a nested dict) for the omni path of `recipe`.

    Mapping: `data.prompts_per_step` -> `data.train_batch_size`; `rollout.n` ->
    `actor_rollout_ref.rollout.n`; `lora.*` -> `actor_rollout_ref.model.lora_*`;
    `optimizer.*` -> `actor_rollout_ref.actor.optim.*` and `grad_clip`;
    `algorithm.name` -> `actor_rollout_ref.actor.policy_loss.loss_mode` = `omni_<name>`;
    `algorithm.clip_range` -> `clip_ratio(_low/_high)`; `algorithm.num_minibatches` ->
    `ppo_mini_batch_size` (prompts per optimizer step); `algorithm.epochs` -> `ppo_epochs`;
    `algorithm.kl_beta` -> `use_kl_loss` / `kl_loss_coef`; `algorithm.adv_std` ->
    `algorithm.norm_adv_by_std_in_grpo`; `algorithm.adv_clip_max` -> `algorithm.adv_clip_max`
    (a key of ours, read by our advantage estimator `omni_group`); `rollout.max_new_tokens /
    temperature / top_p / val_temperature` -> `data.max_response_length` and the rollout's
    sampling settings; the reward (name, options, extract) -> `reward.custom_reward_function`
    with our `omni_compute_score`; `trainer.nnodes/gpus_per_node/steps/seed` -> `trainer.*` and
    `data.seed`; `trainer.report_to` / `wandb_project` -> `trainer.logger` / `project_name`;
    `trainer.keep_checkpoints` -> `max_actor_ckpt_to_keep`; `trainer.overwrite` -> `resume_mode`
    `disable` (else `auto`: the same command continues the run);
    `ray_kwargs.ray_init.runtime_env.env_vars` = our Ray backend's
    (`omni_train.backends.ray_runtime.WORKER_RUNTIME_ENV`: verl's Ray workers at the driver's
    priority, not Ray's niceness 15; verl merges it onto its own runtime environment). Finally
    every `trainer.verl` entry (dotted key -> value) is set on top.

    Not mapped: `rollout.max_num_seqs` (it sizes our engines' waves, 16 by default; verl's vLLM
    schedules its own sequences: `actor_rollout_ref.rollout.max_num_seqs` through
    `trainer.verl`), and the console settings `trainer.log_every`, `sample_every`, `progress`
    (verl prints its own per-step lines).
    """
    # what verl cannot take is refused when the recipe is built (Recipe._verl_problems)
    r = recipe
    a = r.algorithm
    run = Path(run_dir) if run_dir is not None else r.output_dir()
    row = ALGORITHMS[a.name]
    # the same clip and aggregation as the local and Ray updates
    opts = token_loss_options(row.loss, dict(a.options), a.clip_range, row.token_agg)
    clip_low, clip_high = float(opts.pop("clip_low")), float(opts.pop("clip_high"))
    agg = str(opts.pop("agg"))
    clip_ratio_c = opts.pop("clip_ratio_c", None)  # grpo's dual clip (null: refused for verl)
    if agg not in _AGG:
        raise RecipeError(f"algorithm.options.agg: {agg!r} is not one of {sorted(_AGG)}")
    if r.data.prompts_per_step % a.num_minibatches:
        raise RecipeError("algorithm.num_minibatches: must divide data.prompts_per_step (verl)")
    gpus = max(r.trainer.gpus_per_node, 1)
    model: dict[str, Any] = {
        "path": model_path or r.model.path,
        "external_lib": "omni_train.backends.verl_register",
        "enable_gradient_checkpointing": bool(r.model.options.get("gradient_checkpointing", True)),
        "use_remove_padding": True,
    }
    if tuple(r.optimizer.betas) != (0.9, 0.999):
        extra_optim = {"betas": list(r.optimizer.betas)}
    else:
        extra_optim = {}
    if r.lora.enabled:
        model.update(
            lora_rank=r.lora.rank,
            lora_alpha=r.lora.alpha,
            target_modules=list(r.lora.target_modules) if r.lora.target_modules else "all-linear",
        )
    ro = r.rollout
    cfg: dict[str, Any] = {
        "data": {
            "train_files": train_files or str(run / "verl_data" / "train.parquet"),
            "val_files": val_files or str(run / "verl_data" / "val.parquet"),
            "train_batch_size": r.data.prompts_per_step,
            "prompt_key": "prompt",
            "image_key": IMAGE_KEY,
            "reward_fn_key": "data_source",
            "max_prompt_length": 1024,
            "max_response_length": ro.max_new_tokens,
            "shuffle": r.data.shuffle,
            "seed": r.trainer.seed,
        },
        "actor_rollout_ref": {
            "model": model,
            "hybrid_engine": True,
            "actor": {
                "strategy": "fsdp2",
                "optim": {
                    "lr": r.optimizer.lr,
                    "weight_decay": r.optimizer.weight_decay,
                    **extra_optim,
                },
                "grad_clip": r.optimizer.grad_clip,
                "ppo_mini_batch_size": r.data.prompts_per_step // a.num_minibatches,
                "ppo_micro_batch_size_per_gpu": 1,
                "ppo_epochs": a.epochs,
                "clip_ratio": clip_low,  # verl's symmetric fallback; the two below win
                "clip_ratio_low": clip_low,
                "clip_ratio_high": clip_high,
                **({} if clip_ratio_c is None else {"clip_ratio_c": float(clip_ratio_c)}),
                "loss_agg_mode": agg,
                "policy_loss": {"loss_mode": LOSS_NAMES[a.name]},
                "use_kl_loss": a.kl_beta > 0,
                "kl_loss_coef": a.kl_beta,
                "fsdp_config": {"param_offload": False, "optimizer_offload": False},
            },
            "rollout": {
                "name": "vllm",
                "n": ro.n,
                "temperature": ro.temperature,
                "top_p": ro.top_p,
                "val_kwargs": {
                    "temperature": ro.val_temperature,
                    "top_p": ro.top_p,
                    "do_sample": ro.val_temperature > 0,
                },
                "tensor_model_parallel_size": 1,
                "gpu_memory_utilization": 0.5,
                "log_prob_micro_batch_size_per_gpu": 1,
            },
            "ref": {"log_prob_micro_batch_size_per_gpu": 1},
        },
        "algorithm": {
            "adv_estimator": ADV_ESTIMATOR,
            "norm_adv_by_std_in_grpo": a.adv_std != "none",
            "adv_clip_max": a.adv_clip_max,
            "use_kl_in_reward": False,
        },
        "reward": {
            "custom_reward_function": {
                "path": REWARD_FUNCTION_PATH,
                "name": "omni_compute_score",
                "reward_kwargs": {
                    "reward": r.reward.name,
                    "options": dict(r.reward.options),
                    "extract": r.reward.extract,
                },
            },
        },
        "trainer": {
            "nnodes": r.trainer.nnodes,
            "n_gpus_per_node": gpus,
            "total_training_steps": r.trainer.steps,
            "total_epochs": 1_000_000,
            "project_name": r.trainer.wandb_project,
            "experiment_name": r.experiment,
            "logger": ["console", *r.trainer.report_to],
            "default_local_dir": str(run / "verl_checkpoints"),
            # the same command continues a run, as on the other backends; overwrite starts over
            # (run_verl clears the folder's verl_checkpoints first)
            "resume_mode": "disable" if r.trainer.overwrite else "auto",
            "max_actor_ckpt_to_keep": r.trainer.keep_checkpoints,
            "save_freq": r.trainer.save_every or -1,
            "test_freq": r.trainer.val_every or -1,
            "val_before_train": False,
        },
        "ray_kwargs": {
            "ray_init": {"runtime_env": {"env_vars": dict(WORKER_RUNTIME_ENV["env_vars"])}}
        },
    }
    for key, value in r.trainer.verl.items():
        _set(cfg, key, value)
    return cfg


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _hydra(v: Any) -> str:
    """A value in Hydra's override grammar: `true`, `null`, numbers, bare or quoted strings,
    `[a,b]` lists and `{k:v}` dicts."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        bare = (
            v
            and all(c.isalnum() or c in "_-./+" for c in v)
            and v.lower() not in ("true", "false", "null")
            and not _is_number(v)  # bare `0` would reach verl as an int, not the string "0"
        )
        return v if bare else "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra(x) for x in v) + "]"
    if isinstance(v, dict):
        for k in v:
            if not (isinstance(k, str) and k.replace("_", "a").isalnum()):
                raise RecipeError(f"verl config: key {k!r} is not a plain identifier")
        return "{" + ",".join(f"{k}:{_hydra(x)}" for k, x in v.items()) + "}"
    raise RecipeError(f"verl config: cannot express {type(v).__name__} value {v!r} for Hydra")


def to_overrides(cfg: dict[str, Any], prefix: str = "") -> list[str]:
    """Hydra command-line overrides `a.b.c=value`, sorted so the command line is stable.

    A dict under one of `ADDED_KEYS` is one value, added with `++key=value` (verl's schema does
    not declare it, so a plain `key=value` would be rejected as not in struct)."""
    out: list[str] = []
    for k in sorted(cfg):
        v = cfg[k]
        key = f"{prefix}{k}"
        if key in ADDED_KEYS:
            out.append(f"++{key}={_hydra(v)}")
        elif isinstance(v, dict) and v:
            out.extend(to_overrides(v, key + "."))
        else:
            out.append(f"{key}={_hydra(v)}")
    return out


# ---------------------------------------------------------------------------------------------
# losses, advantages, rewards in verl's signatures


def _cfg_get(config: Any, name: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, dict):
        v = config.get(name, default)
    else:
        v = getattr(config, name, default)
    return default if v is None else v


def global_batch_scale(agg: str, mask: torch.Tensor, info: Mapping[str, Any]) -> float:
    """The factor from our loss over one micro-batch to verl's share of its global batch.

    Our losses aggregate over the rows they are given (`omni_algos.losses.agg_loss`). verl 0.9
    calls backward once per micro-batch, and its own losses aggregate over the whole global
    mini-batch instead (`core_algos.agg_loss(..., **config.global_batch_info)`, the info filled
    by `verl.workers.utils.losses.ppo_loss`): divided by the global batch's tokens
    (``batch_num_tokens``, token-mean) or responses (``global_batch_size``, the seq-mean modes)
    and multiplied by ``dp_size`` (FSDP averages the ranks' gradients); seq-mean-token-sum-norm
    divides by ``loss_scale_factor`` where it is set instead of the padded length. Without the
    global sizes (one rank) verl aggregates over the micro-batch, as we do.
    """
    dp = int(info.get("dp_size") or 1)
    if agg == "token-mean":
        local, total = mask.sum(), info.get("batch_num_tokens")
    else:
        local, total = (mask.sum(-1) > 0).sum(), info.get("global_batch_size")
    if total is None:
        if dp > 1:  # verl's agg_loss refuses this too
            raise ValueError(f"verl gave dp_size {dp} but not the global batch's size ({agg})")
        scale = 1.0
    else:
        scale = float(local) * dp / float(total)
    norm = info.get("loss_scale_factor")
    if agg == "seq-mean-token-sum-norm" and norm is not None:
        scale *= mask.shape[-1] / float(norm)
    return scale


def verl_policy_loss(name: str):
    """Our `omni_algos.losses.<name>` as a verl policy loss.

    verl passes `(old_log_prob, log_prob, advantages, response_mask)` of shape (B, T), the
    `loss_agg_mode` and the actor config (`clip_ratio_low`, `clip_ratio_high`,
    `clip_ratio_c`, `global_batch_info`); the result is `(loss, metrics)` with verl's metric
    names (`actor/pg_clipfrac`, `actor/ppo_kl`) plus ours under `actor/omni_*`, the loss
    scaled to verl's share of the global batch (`global_batch_scale`).
    `rollout_is_weights` (verl's rollout correction) multiply the per-token loss: GRPO/GSPO
    are linear in a per-token weight, so the loss is recomputed with advantages * weights.
    """
    from omni_algos.losses import LOSSES

    if name not in LOSS_NAMES:
        raise ValueError(f"verl_policy_loss: {name!r} is not one of {sorted(LOSS_NAMES)}")
    fn = LOSSES[name]

    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        clip = float(_cfg_get(config, "clip_ratio", 0.2))
        kw: dict[str, Any] = {
            "clip_low": float(_cfg_get(config, "clip_ratio_low", clip)),
            "clip_high": float(_cfg_get(config, "clip_ratio_high", clip)),
            "agg": _AGG.get(loss_agg_mode, loss_agg_mode),
        }
        if name == "grpo":
            kw["clip_ratio_c"] = float(_cfg_get(config, "clip_ratio_c", 3.0))
        adv = advantages if rollout_is_weights is None else advantages * rollout_is_weights
        out = fn(log_prob, old_log_prob, adv, response_mask, **kw)
        m = response_mask.to(log_prob.dtype)
        den = m.sum().clamp(min=1)
        ppo_kl = float((-(log_prob - old_log_prob).detach() * m).sum() / den)
        metrics = {
            "actor/pg_clipfrac": float(out.metrics.get("clipfrac", 0.0)),
            "actor/ppo_kl": ppo_kl,
            "actor/pg_clipfrac_lower": float(out.metrics.get("clipfrac_lower", 0.0)),
        }
        metrics.update({f"actor/omni_{k}": float(v) for k, v in out.metrics.items()})
        info = _cfg_get(config, "global_batch_info", None) or {}
        return out.loss * global_batch_scale(kw["agg"], response_mask, info), metrics

    policy_loss.__name__ = f"omni_{name}_policy_loss"
    policy_loss.__qualname__ = policy_loss.__name__
    return policy_loss


def omni_group_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl advantage estimator: `omni_algos.advantages.group_advantages` on the sequence
    rewards `sum_t token_level_rewards`, groups from verl's `index` (the prompt uid), clipped
    to +-`adv_clip_max` as our loops clip them, broadcast over the response tokens; returns
    (advantages, returns) like verl's GRPO.

    verl 0.9's `compute_advantage` hands an estimator it does not know its algorithm
    ``config``, not the ``norm_adv_by_std_in_grpo`` keyword: the settings are read from there
    (`adv_clip_max` is ours, added to verl's algorithm config by `build_verl_config`; without
    it nothing is clipped)."""
    from omni_algos.advantages import group_advantages

    if config is not None:
        norm_adv_by_std_in_grpo = bool(
            _cfg_get(config, "norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
        )
    clip = _cfg_get(config, "adv_clip_max")

    scores = token_level_rewards.sum(dim=-1)
    ids: dict[Any, int] = {}
    groups = [ids.setdefault(u, len(ids)) for u in list(index)]
    adv = group_advantages(
        scores.float(),
        torch.as_tensor(groups),
        std="group" if norm_adv_by_std_in_grpo else "none",
        eps=epsilon,
    )
    if clip is not None:
        adv = adv.clamp(-float(clip), float(clip))
    adv = adv.to(token_level_rewards.dtype)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


_REWARDS: dict[str, Any] = {}


def _plain(value: Any) -> Any:
    """Mappings and sequences as plain dicts and lists: verl hands `reward_kwargs` over with
    omegaconf containers inside."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def omni_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    *,
    reward: str = "math",
    options: dict[str, Any] | None = None,
    extract: str = "response",
    **_: Any,
) -> float:
    """verl `reward.custom_reward_function`: score one response with `omni_rewards.load_reward`.

    `reward` / `options` / `extract` come from `reward.custom_reward_function.reward_kwargs`;
    the response is `texts` (with `extract: first_letter`, only its first free-standing choice
    letter, as the local omni loop scores it), the ground truth `references`, the prompt (verl
    passes our `extra_info`) `prompts`."""
    import omni_rewards

    options = _plain(options or {})
    key = json.dumps([reward, options], sort_keys=True)
    if key not in _REWARDS:
        _REWARDS[key] = omni_rewards.load_reward(reward, **options)
    if extract == "first_letter":
        letters = str(options.get("letters", CHOICE_LETTERS))
        solution_str = first_choice_letter(solution_str, letters)
    elif extract != "response":
        raise ValueError(f"extract: 'response' or 'first_letter', got {extract!r}")
    prompt = (extra_info or {}).get("prompt") or ""
    out = _REWARDS[key](
        omni_rewards.RewardInput(
            texts=[solution_str],
            references=[ground_truth] if ground_truth is not None else None,
            prompts=[prompt],
        )
    )
    return float(out.scores[0])


# ---------------------------------------------------------------------------------------------
# registration (needs verl)


def register_into_verl() -> dict[str, list[str]]:
    """Register our losses and advantage estimator in verl's registries; returns what went
    where. Idempotent (re-registering the same object is a no-op). The reward needs no
    registration: verl's default (naive) reward manager calls `reward.custom_reward_function`."""
    try:
        from verl.trainer.ppo import core_algos
    except Exception as exc:  # pragma: no cover - only without verl
        raise TrainError(
            f"trainer.backend: 'verl' needs verl in its own environment ({exc}); see "
            f"docs/scaling.md"
        ) from None
    done: dict[str, list[str]] = {"policy_loss": [], "adv_estimator": []}
    for ours, theirs in LOSS_NAMES.items():
        if theirs not in core_algos.POLICY_LOSS_REGISTRY:
            core_algos.register_policy_loss(theirs)(verl_policy_loss(ours))
        done["policy_loss"].append(theirs)
    if core_algos.ADV_ESTIMATOR_REGISTRY.get(ADV_ESTIMATOR) is not omni_group_advantage:
        core_algos.register_adv_est(ADV_ESTIMATOR)(omni_group_advantage)
    done["adv_estimator"].append(ADV_ESTIMATOR)
    return done


# ---------------------------------------------------------------------------------------------
# the data


def omni_items(recipe: Recipe) -> tuple[list[OmniItem], list[OmniItem]]:
    """(train, val) items of the omni path, read as the local omni loop reads them: the
    generated `data.task` (its train and held-out val splits) or the JSONL `data.file`
    (validation: `data.val_file`, else its first `data.val_size` rows)."""
    d, seed = recipe.data, recipe.trainer.seed
    opts = dict(d.task_options)
    train = load_items(d.task, d.file, "train", d.task_size, seed, opts, "data.file")
    if d.val_file is not None:
        val = load_items(None, d.val_file, "val", 0, 0, {}, "data.val_file")
    elif d.task is not None:
        val = load_items(d.task, None, "val", d.val_size, seed, opts, "data.task")
    else:
        val = train[: d.val_size]
    return train, val


def _png(image: Any) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def _verl_row(item: OmniItem, index: int) -> dict[str, Any]:
    """One row of verl's RLHF parquet. An image goes into `images` as `{"bytes": PNG}` (what
    `RLHFDataset._build_messages` opens) and the prompt text starts with the `<image>`
    placeholder it replaces by that image."""
    content = item.prompt if item.image is None else "<image>" + item.prompt
    return {
        "data_source": "omni",
        "prompt": [{"role": "user", "content": content}],
        IMAGE_KEY: None if item.image is None else [{"bytes": _png(item.image)}],
        "reward_model": {"style": "rule", "ground_truth": item.answer},
        "extra_info": {"index": index, "prompt": item.prompt},
    }


def write_dataset(recipe: Recipe, out: Path) -> tuple[str, str]:
    """Write `train.parquet` / `val.parquet` in verl's RLHF layout (`data_source`, `prompt`
    chat messages, `images`, `reward_model`, `extra_info`); returns their paths."""
    import pandas as pd  # verl dependency

    train_items, val_items = omni_items(recipe)
    out.mkdir(parents=True, exist_ok=True)
    train, val = out / "train.parquet", out / "val.parquet"
    pd.DataFrame([_verl_row(it, i) for i, it in enumerate(train_items)]).to_parquet(train)
    pd.DataFrame([_verl_row(it, i) for i, it in enumerate(val_items)]).to_parquet(val)
    return str(train), str(val)


# ---------------------------------------------------------------------------------------------
# the run (needs verl and, for its rollout, a GPU)


def export_thinker(recipe: Recipe, out: Path) -> str:
    """Load the model through our Qwen3-Omni thinker adapter (talker stripped) and save the
    thinker with its processor as a plain HF folder verl can load."""
    from omni_adapters import from_pretrained

    from ..models import ensure_model

    path = ensure_model(recipe)
    adapter = from_pretrained(path, stage="thinker", dtype=recipe.model.dtype, device="cpu")
    out.mkdir(parents=True, exist_ok=True)
    adapter.model.save_pretrained(out)
    for name, obj in adapter.components.items():
        if ("tokenizer" in name or "processor" in name) and hasattr(obj, "save_pretrained"):
            obj.save_pretrained(out)
    return str(out)


def run_verl(recipe: Recipe, run_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Start verl's PPO trainer on the omni path of `recipe` (returns no per-step rows: verl
    logs them itself, under `trainer.logger`)."""
    if not verl_available():
        raise TrainError(
            "trainer.backend: 'verl' needs verl, which pins transformers < 5.11: create its own "
            "environment with `UV_PROJECT_ENVIRONMENT=.venv-verl uv sync --extra verl` "
            "(docs/scaling.md)"
        )
    run = (Path(run_dir) if run_dir is not None else recipe.output_dir()).resolve()
    checkpoints = run / "verl_checkpoints"
    if recipe.trainer.overwrite and checkpoints.exists():  # else verl resumes from them
        print(f"trainer.overwrite: starting over in {run}", flush=True)
        shutil.rmtree(checkpoints)
    register_into_verl()
    train, val = write_dataset(recipe, run / "verl_data")
    model = export_thinker(recipe, run / "verl_model")
    cfg = build_verl_config(recipe, model_path=model, train_files=train, val_files=val, run_dir=run)
    (run / "verl_config.json").write_text(json.dumps(cfg, indent=1))
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *to_overrides(cfg)]
    # Hydra writes its outputs/ folder into the working directory: the run folder, not the caller's.
    res = subprocess.run(cmd, check=False, cwd=run)
    if res.returncode:
        raise TrainError(
            f"verl's PPO trainer exited with {res.returncode}: {' '.join(cmd[:4])} ..."
        )
    return []
