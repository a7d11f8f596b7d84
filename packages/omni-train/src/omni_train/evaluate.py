"""`omni-train eval RUN_OR_MODEL --prompts FILE`: sample a policy on a prompt set and score it.

What is sampled, from ``RUN_OR_MODEL``:

- a run folder (it holds ``recipe.yaml``): the policy as trained. The run's recipe, and the
  trainable weights (LoRA, or the full weights of `lora.enabled: false`) of its newest
  checkpoint that verifies (`omni_train.checkpoint.newest_good_checkpoint`; ``--checkpoint N``
  picks step N's), loaded into the policy exactly as `omni-train resume` loads them; the EMA
  weights when `optimizer.ema_decay > 0`, as the run's own validation samples.
- a model folder (``model_index.json``): the base model, no LoRA. Its rollout settings
  (size, steps, guidance), dtype, device and reward come from ``--recipe R`` when given
  (with `model.path` replaced by the folder, `model.tiny` dropped), else from the recipe
  defaults (64x64, 10 steps, no CFG) and ``--reward`` is required. ``key=value`` overrides
  change either, e.g. ``rollout.height=32 rollout.width=32 model.device=cuda``.

Sampling is deterministic: the ODE sampler (`sde_kind: ode`, noise 0, no SDE window) at the
recipe's rollout settings with `trainer.val_num_steps` (else `rollout.num_steps`) steps, in
the embedded engine (whatever `rollout.backend` says). Sample k of prompt i has the seed
``derive_seed(S, 0, i * 1000 + k, DOMAIN_VAL)`` (`omni_train.seeds`), the seed the training
loop's validation gives it (`DiffusionLoop.validate`); so ``--seed`` = `trainer.seed` and
``--n`` = `trainer.val_samples_per_prompt` (the defaults) on the run's `data.val_file`
reproduce the run's last `val/reward_mean`
(tests/test_evaluate.py::test_eval_of_a_run_reproduces_its_validation).

Prompts: ``FILE`` in the format of `data.file` (`omni_train.data.read_data_file`: .txt one
prompt a line, .jsonl with a ``prompt`` (and ``image`` for editing models), .parquet).

The result (`evaluate` returns it, the CLI prints it as one JSON object on stdout and writes
it to ``OUT/eval.json`` next to the labelled grid ``OUT/grid.png``):

    target, kind ("run" | "model"), checkpoint (path or null), prompts (FILE), reward,
    n, seed, num_steps, height, width, out (OUT),
    count                 images scored (prompts x n)
    mean, std, stderr     of the per-image rewards; stderr = std / sqrt(count)
    per_prompt            [{prompt, mean, scores, distinct}] in file order; distinct: how
                          many of the prompt's n images differ (byte for byte)
    diversity             the mean per-element std of a prompt's final latents over their std
                          across all samples (`samples/diversity` of training): 0 = every
                          prompt's samples collapsed into one image; null for n = 1
    details               {key: mean} of each numeric per-sample detail the reward reports
                          (`RewardOutput.details`, NaN = not applicable, skipped)
    per_task              {task: {mean, count}}: the reward per task type, when the reward
                          reports ``details["task_<type>"]`` (its score where the sample is
                          of that type, NaN elsewhere; the `shapes` reward does, and training
                          logs the same keys as ``reward/task_<type>``), or a `MultiReward`
                          term's ``"<term>/task_<type>"``; else {}
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from .checkpoint import (
    CheckpointError,
    checkpoint_of_step,
    load_checkpoint,
    newest_good_checkpoint,
)
from .data import read_data_file
from .errors import TrainError
from .loops.diffusion import group_stats, media_fields, still_frames
from .models import ensure_model, is_saved_model, load_policy, load_trainable, quiet_libraries
from .plots import save_prompt_grid, score_labels
from .recipe import Recipe, RecipeError, apply_overrides, recipe_from_dict, unknown_name
from .rewards import build_reward
from .seeds import DOMAIN_VAL, derive_seed

__all__ = ["MAX_N", "eval_recipe", "evaluate", "load_base", "load_run_policy", "summarize"]

#: samples per prompt at most: sample k of prompt i has the index i * MAX_N + k, as in the
#: training loop's validation (`DiffusionLoop.validate`: i * 1000 + k)
MAX_N = 1000

#: the prefix of the detail keys a reward reports its per-task scores under (module docstring)
TASK_PREFIX = "task_"


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise RecipeError(f"{what} {path}: cannot be read as YAML ({exc})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{what} {path}: the top level must be a mapping of sections")
    return data


def eval_recipe(
    target: str | Path,
    *,
    recipe: str | Path | None = None,
    reward: str | None = None,
    overrides: list[str] | None = None,
    prompts: list[str] | None = None,
) -> tuple[Recipe, str]:
    """The recipe to sample ``target`` with, and its kind ("run" or "model") (module
    docstring). ``prompts`` stand in for `data.prompts` of a model without a recipe."""
    p = Path(target).expanduser()
    if not p.exists():
        raise TrainError(f"RUN_OR_MODEL: {p} does not exist")
    if (p / "recipe.yaml").is_file():
        if recipe is not None:
            raise RecipeError(f"--recipe: {p} is a run folder; its own recipe.yaml is used")
        kind, source = "run", p / "recipe.yaml"
        data = _read_yaml(source, "RUN_OR_MODEL")
        data.setdefault("trainer", {})["output_dir"] = str(p)
    elif is_saved_model(p):
        kind = "model"
        if recipe is not None:
            source = Path(recipe)
            if not source.is_file():
                raise RecipeError(f"--recipe: {source} does not exist")
            data = _read_yaml(source, "--recipe")
        else:
            if reward is None:
                raise RecipeError(
                    f"--reward: {p} is a model folder and no --recipe is given, so name the "
                    "reward (e.g. --reward brightness)"
                )
            source = p
            data = {
                "data": {"prompts": list(prompts or ["-"])},
                # the ODE sample has no SDE window; this one fits any rollout.num_steps
                "rollout": {"sde_window_size": 1, "sde_window_range": [0, 1]},
            }
        model = data.get("model") if isinstance(data.get("model"), dict) else {}
        data["model"] = {**model, "path": str(p), "tiny": None}
    else:
        raise TrainError(
            f"RUN_OR_MODEL: {p} is neither a run folder (no recipe.yaml) nor a saved model "
            "(no model_index.json or config.json)"
        )
    if reward is not None:
        from omni_rewards import available_rewards

        known = available_rewards()
        if reward not in known:
            raise RecipeError(unknown_name("--reward", "reward", reward, known))
        data["reward"] = {"name": reward}
    apply_overrides(data, list(overrides or []))
    r = recipe_from_dict(data, source=f"recipe {source}")
    if r.is_omni():
        raise TrainError(
            f"RUN_OR_MODEL: {p} is an autoregressive (omni) model; omni-train eval samples "
            "diffusion models"
        )
    if "audio" in r.reward.inputs:
        raise TrainError("reward.inputs: omni-train eval scores images, videos or latents")
    return r, kind


def _checkpoint(run: Path, step: int | None) -> Path:
    """Step `step`'s checkpoint (verified), else the newest one that verifies."""
    if step is not None:
        try:
            return checkpoint_of_step(run, step)
        except CheckpointError as e:
            raise TrainError(f"--checkpoint: {e}") from None
    ck, skipped = newest_good_checkpoint(run / "checkpoint")
    for why in skipped:
        print(f"eval: {why}; falling back to an older checkpoint", file=sys.stderr)
    if ck is None:
        why = f" ({skipped[-1]})" if skipped else ""
        raise TrainError(
            f"RUN_OR_MODEL: {run} has no checkpoint that verifies under {run / 'checkpoint'}"
            f"{why}; evaluate the base model by passing its folder instead"
        )
    return ck


def load_run_policy(recipe: Recipe, checkpoint: Path) -> Any:
    """The run's policy: `load_policy` (LoRA set up as in training) with the checkpoint's
    trainable tensors copied in (`load_trainable`, as resume does), every parameter frozen."""
    adapter = load_policy(recipe)
    trainable = load_checkpoint(checkpoint).trainable
    load_trainable(adapter, adapter.named_trainable_parameters(), trainable, recipe)
    adapter.set_trainable("frozen")
    return adapter


def load_base(recipe: Recipe) -> Any:
    """The model of `model.path` as saved, every parameter frozen, no LoRA."""
    from omni_adapters import from_pretrained

    m = recipe.model
    path = ensure_model(recipe)
    try:
        adapter = from_pretrained(path, dtype=m.dtype, device=m.device, **m.options)
    except (ValueError, FileNotFoundError) as exc:
        raise TrainError(f"RUN_OR_MODEL: cannot load {path}: {exc}") from None
    if not hasattr(adapter, "init_latents"):
        raise TrainError(
            f"RUN_OR_MODEL: {path} is a {type(adapter).__name__}, not a diffusion model; "
            "omni-train eval samples diffusion models"
        )
    adapter.set_trainable("frozen")
    if hasattr(adapter, "latent_shape"):  # a size the model cannot take fails here, by key
        try:
            adapter.latent_shape(recipe.sampling_params())
        except ValueError as exc:
            raise RecipeError(f"rollout.{exc} for {type(adapter).__name__}") from None
    return adapter


def _nan_to_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def summarize(
    prompts: list[str], scores: np.ndarray, details: dict[str, np.ndarray], n: int
) -> dict[str, Any]:
    """count, mean, std, stderr, per_prompt, details and per_task of ``scores`` (prompt i's
    samples at rows i * n ... i * n + n - 1) and the reward's per-sample ``details``."""
    scores = np.asarray(scores, dtype=np.float64)
    count = int(scores.size)
    std = float(scores.std())
    out: dict[str, Any] = {
        "count": count,
        "mean": _nan_to_none(float(scores.mean())),
        "std": _nan_to_none(std),
        "stderr": _nan_to_none(std / math.sqrt(count)),
        "per_prompt": [
            {
                "prompt": prompt,
                "mean": _nan_to_none(float(scores[i * n : (i + 1) * n].mean())),
                "scores": [_nan_to_none(float(s)) for s in scores[i * n : (i + 1) * n]],
            }
            for i, prompt in enumerate(prompts)
        ],
        "details": {},
        "per_task": {},
    }
    for key, value in details.items():
        arr = np.asarray(value)
        if arr.ndim != 1 or len(arr) != count:
            continue  # e.g. color_match's (B, 3) target colours
        if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
            continue
        vals = arr.astype(np.float64)
        finite = vals[np.isfinite(vals)]
        out["details"][key] = float(finite.mean()) if finite.size else None
        task = key.rsplit("/", 1)[-1]
        if task.startswith(TASK_PREFIX) and finite.size:
            out["per_task"][task.removeprefix(TASK_PREFIX)] = {
                "mean": float(finite.mean()),
                "count": int(finite.size),
            }
    return out


def evaluate(
    target: str | Path,
    prompts_file: str | Path,
    *,
    reward: str | None = None,
    n: int | None = None,
    seed: int | None = None,
    out: str | Path | None = None,
    recipe: str | Path | None = None,
    checkpoint: int | None = None,
    overrides: list[str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Sample ``n`` images per prompt of ``prompts_file`` with the policy of ``target`` (ODE,
    seeds from ``seed``), score them, write ``OUT/eval.json`` and ``OUT/grid.png``; returns
    the result (module docstring). ``n`` and ``seed`` default to the recipe's
    `trainer.val_samples_per_prompt` and `trainer.seed`; ``out`` to ``RUN/eval/<FILE stem>``
    for a run, ``runs/eval/<model folder name>-<FILE stem>`` for a model."""
    import torch

    from diffusion_rollout import EmbeddedEngine, RolloutRequest
    from omni_rewards import RewardError, RewardInput

    rows = read_data_file(prompts_file, "--prompts")
    prompts = [row.prompt for row in rows]
    r, kind = eval_recipe(
        target, recipe=recipe, reward=reward, overrides=overrides, prompts=prompts
    )
    if checkpoint is not None and kind != "run":
        raise RecipeError("--checkpoint: only for a run folder")
    n = r.trainer.val_samples_per_prompt if n is None else n
    seed = r.trainer.seed if seed is None else seed
    if not 1 <= n <= MAX_N:
        raise RecipeError(f"--n: samples per prompt must be 1 to {MAX_N}, got {n}")
    if seed < 0:
        raise RecipeError(f"--seed: must be >= 0, got {seed}")
    target = Path(target).expanduser()
    dest = Path(out) if out is not None else None
    if dest is None:
        stem = Path(prompts_file).stem
        if kind == "run":
            dest = target / "eval" / stem
        else:
            dest = Path("runs") / "eval" / f"{target.name}-{stem}"
    if dest.exists() and not dest.is_dir():
        raise RecipeError(f"--out: {dest} is a file, not a folder")

    if isinstance(r.trainer.threads, int):
        torch.set_num_threads(r.trainer.threads)
    quiet_libraries()
    reward_key = "--reward" if reward is not None else "reward.name"
    scorer = build_reward(r)  # before sampling: a reward that cannot load fails first
    ck: Path | None = None
    if kind == "run":
        ck = _checkpoint(target, checkpoint)
        adapter = load_run_policy(r, ck)
    else:
        adapter = load_base(r)
    needs_images = bool(getattr(adapter, "needs_images", False))
    if needs_images:
        for i, row in enumerate(rows):
            if row.image is None:
                raise RecipeError(
                    f"--prompts {prompts_file}: the model is image-conditioned; row {i + 1} "
                    f"(prompt {row.prompt!r:.60}) has no 'image'"
                )

    num_steps = r.trainer.val_num_steps or r.rollout.num_steps
    params = r.sampling_params(
        sde_kind="ode",
        noise_level=0.0,
        num_steps=num_steps,
        sde_window_size=None,
        sde_window_range=None,
        output="both",
    )
    reqs = []
    for i, row in enumerate(rows):
        image = row.image.load() if needs_images and row.image is not None else None
        for k in range(n):
            reqs.append(
                RolloutRequest(
                    prompt=row.prompt,
                    seed=derive_seed(seed, 0, i * MAX_N + k, DOMAIN_VAL),  # the validation's
                    params=params,
                    request_id=f"eval-{len(reqs)}",
                    image=image,
                )
            )
    with EmbeddedEngine(adapter, max_num_seqs=r.rollout.max_num_seqs) as engine:
        if r.optimizer.ema_decay > 0 and kind == "run":  # the weights the run validates with
            with adapter.use_adapter("ema"):
                trajs = engine.generate_many(reqs, progress=progress)
        else:
            trajs = engine.generate_many(reqs, progress=progress)

    media = torch.stack([t.media for t in trajs]).numpy()
    fields: dict[str, Any] = {"prompts": [t.prompt for t in trajs]}
    if "media" in r.reward.inputs:
        fields.update(media_fields(media))
    if "latents" in r.reward.inputs:
        fields["latents"] = torch.stack([t.final_latent for t in trajs]).float().numpy()
    try:
        result = scorer(RewardInput(**fields))
    except (RewardError, ValueError) as exc:  # e.g. a prompt the reward cannot parse
        raise TrainError(f"{reward_key} {r.reward.name or 'terms'}: {exc}") from None
    scores = np.asarray(result.scores, dtype=np.float64)

    summary = {
        "target": str(target),
        "kind": kind,
        "checkpoint": None if ck is None else str(ck),
        "prompts": str(prompts_file),
        "reward": r.reward.name or "+".join(t.name for t in r.reward.terms or []),
        "n": n,
        "seed": seed,
        "num_steps": num_steps,
        "height": r.rollout.height,
        "width": r.rollout.width,
        "out": str(dest),
        **summarize(prompts, scores, result.details or {}, n),
        # collapse: 0 when each prompt's samples are one image, ~1 as varied as the batch
        "diversity": group_stats(scores, n, trajs).get("samples/diversity") if n > 1 else None,
    }
    for i, entry in enumerate(summary["per_prompt"]):
        entry["distinct"] = len({m.tobytes() for m in media[i * n : (i + 1) * n]})
    dest.mkdir(parents=True, exist_ok=True)
    save_prompt_grid(
        still_frames(media),
        dest / "grid.png",
        prompts,
        n,
        labels=score_labels(scores, result.details),
    )
    (dest / "eval.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
