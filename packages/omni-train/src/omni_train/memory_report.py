"""`omni-train validate --memory RECIPE`: a per-GPU training-memory estimate of a GPU recipe.

The released model is built at full size on the meta device (no weights) from its published
configs (`omni_adapters.published`, picked by `--published NAME` or by the recipe's
`model.path` folder name; a local folder that holds the model's configs is read instead),
with the recipe's LoRA (or `lora.full_regex`) applied, and `omni_adapters.memory` turns the
counts and one training forward's shape into bytes. The training forward holds
``min(prompts_per_step * n / workers / num_minibatches, algorithm.rows_per_forward)`` rows
(`rows_per_forward` defaults to `rollout.max_num_seqs`; twice that with classifier-free
guidance, both branches in one forward); the rollout holds `max_num_seqs` rows (twice with
guidance). A diffusion LoRA rollout samples a merged copy of the policy
(`OmniModelBase.merged_rollout_copy`), which holds the LoRA-wrapped layers' weights a second
time (not in the synchronous local loop with an EMA adapter, which samples the policy itself).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from .recipe import Recipe, RecipeError

__all__ = ["memory_report"]


def _published_model(recipe: Recipe, published: str | None) -> Any:
    from omni_adapters import published as pub

    if published is not None:
        try:
            return pub.load(published)
        except ValueError as exc:
            raise RecipeError(f"--published: {exc}") from None
    found = pub.match_path(recipe.model.path)
    if found is None:
        raise RecipeError(
            f"model.path: {recipe.model.path} is not the folder of a published model (its name "
            f"is none of theirs); pass --published NAME, one of {pub.names()}"
        )
    return found


#: GPU memory sizes (GiB) reported by default
GPU_SIZES = {80.0: "A100/H100 80 GB", 141.0: "H200"}


def _fit_lines(
    gib: float, est: Any, kwargs: dict[str, Any], recipe: Recipe, rows: int, cfg: int
) -> list[str]:
    """Whether the estimate fits ``gib``; if not, the smallest change that does."""
    from omni_adapters.memory import GIB, estimate_training_memory, largest_fitting_rows

    label = GPU_SIZES.get(gib, "")
    name = f"{gib:g} GiB" + (f" ({label})" if label else "")
    gpu = gib * GIB
    if est.fits(gpu):
        return [f"  fits in {name}: yes"]
    out = [f"  fits in {name}: no"]
    options = [(False, "as is"), (True, "with model.options.gradient_checkpointing=true")]
    if kwargs["gradient_checkpointing"]:
        options = [(True, "as is")]
    for ckpt, how in options:
        one = estimate_training_memory(**{**kwargs, "rows": cfg, "gradient_checkpointing": ckpt})
        if not one.fits(gpu):
            out.append(f"    {how}: even {cfg} row(s) per forward do not fit; shard over more GPUs")
            continue
        best = largest_fitting_rows(gpu, **{**kwargs, "gradient_checkpointing": ckpt})
        out.append(
            f"    {how}: {best} rows per forward fit: algorithm.rows_per_forward="
            f"{max(1, best // cfg)}"
        )
    return out


def _auto_line(gib: float, est: Any, kwargs: dict[str, Any], cfg: int) -> str:
    """What ``rows_per_forward: auto`` would choose from the second update on, if the GPU
    held exactly the estimate (`omni_train.updates.auto_rows`)."""
    from omni_adapters.memory import GIB, activation_bytes

    from .updates.auto_rows import CUDA_SHARE, rows_within

    held = sum(v for k, v in est.parts.items() if not k.startswith("activations"))
    per_row = activation_bytes(
        1,
        kwargs["tokens"] * kwargs["hidden_size"],
        kwargs["num_layers"],
        gradient_checkpointing=kwargs["gradient_checkpointing"],
    )
    samples = rows_within(CUDA_SHARE * (gib * GIB - held), per_row * cfg)
    branches = f" ({samples * cfg} forward rows with the guidance branch)" if cfg > 1 else ""
    return f"    algorithm.rows_per_forward auto: {samples} from the second update on{branches}"


def memory_report(
    recipe: Recipe, *, published: str | None = None, gpu_gib: float | None = None
) -> list[str]:
    """Lines describing the estimate (see the module docstring) and whether it fits
    ``gpu_gib`` (default: 80 and 141 GiB); `RecipeError` naming the key when the recipe's
    model cannot be matched to a published one."""
    from omni_adapters import from_pretrained, is_saved_model
    from omni_adapters import published as pub
    from omni_adapters.memory import estimate_training_memory, model_dims, sequence_tokens
    from omni_rewards.sizes import reward_bytes

    from .updates.auto_rows import guidance_branches

    if recipe.model.tiny is not None:
        return [
            f"memory: model.tiny {recipe.model.tiny} is a CPU model; --memory is for GPU recipes"
        ]
    model = _published_model(recipe, published)
    path = Path(recipe.model.path)
    stage = {"stage": model.stage} if model.stage else {}
    if is_saved_model(path):
        adapter = from_pretrained(path, device="meta", **stage)
        source = f"the configs in {path}"
    else:
        adapter = pub.build_meta(model)
        source = f"omni_adapters/published/{model.name}.json"
    is_thinker = model.family == "qwen3_omni_thinker"
    # weights as a checkpoint holds them (parameters and persistent buffers), before LoRA
    trainable = pub.checkpoint_count(adapter.model)
    lora = recipe.lora.enabled
    if lora:
        modules = adapter.add_lora(
            recipe.lora.rank, recipe.lora.alpha, target_modules=recipe.lora.target_modules
        )
        trained = sum(p.numel() for p in adapter.trainable_parameters())
        what = f"LoRA r{recipe.lora.rank} on {modules} modules: {trained / 1e6:.1f}M parameters"
    else:
        named = [(n, p.numel()) for n, p in adapter.model.named_parameters()]
        if recipe.lora.full_regex is not None:
            pattern = re.compile(recipe.lora.full_regex)
            named = [(n, k) for n, k in named if pattern.fullmatch(n)]
        trained = sum(k for _, k in named)
        what = f"full fine-tuning of {len(named)} tensors: {trained / 1e9:.2f}B parameters"
    weight_bytes = 2 if recipe.model.dtype in ("bfloat16", "float16") else 4
    frozen: dict[str, float] = {}
    for name, comp in adapter.components.items():
        if name != adapter.trainable_component and hasattr(comp, "state_dict"):
            frozen[name] = weight_bytes * pub.checkpoint_count(comp)
    for name, n in pub.frozen_published(model, adapter.components).items():
        frozen[name] = weight_bytes * n
    t = recipe.trainer
    shares_policy = t.backend == "local" and t.mode == "sync" and recipe.optimizer.ema_decay > 0
    if lora and not is_thinker and not shares_policy:
        frozen["merged LoRA rollout"] = weight_bytes * adapter.lora_base_params()
    terms = (
        [recipe.reward.name] if recipe.reward.name else [t.name for t in recipe.reward.terms or []]
    )
    for term in terms:
        if reward_bytes(term):
            frozen[f"reward {term}"] = reward_bytes(term)
    r, a = recipe.rollout, recipe.algorithm
    workers = t.num_workers if t.backend in ("ray", "verl") else 1
    per_worker = math.ceil(recipe.data.prompts_per_step * r.n / workers)
    cfg = 1 if is_thinker else guidance_branches(recipe)
    auto = a.rows_per_forward == "auto"  # the first update runs at max_num_seqs rows
    per_forward = r.max_num_seqs if auto else a.rows_per_forward or r.max_num_seqs
    rows = cfg * min(math.ceil(per_worker / a.num_minibatches), per_forward)
    rollout_rows = cfg * min(r.max_num_seqs, per_worker)
    tokens = sequence_tokens(
        model.geometry,
        height=r.height,
        width=r.width,
        num_frames=r.num_frames,
        new_tokens=r.max_new_tokens,
    )
    hidden, layers = model_dims(adapter.model)
    checkpointing = bool(recipe.model.options.get("gradient_checkpointing", False))
    kwargs: dict[str, Any] = {
        "trainable_params": trainable,
        "frozen_bytes": frozen,
        "trained_params": trained,
        "lora": lora,
        "hidden_size": hidden,
        "num_layers": layers,
        "tokens": tokens,
        "rows": rows,
        "rollout_rows": rollout_rows,
        "shards": workers,
        "weight_bytes": weight_bytes,
        "gradient_checkpointing": checkpointing,
        "vocab_size": int(model.geometry.get("vocab", 0)),
    }
    est = estimate_training_memory(**kwargs)
    lines = [
        f"memory estimate for {recipe.experiment} ({model.repo_id}, from {source}):",
        f"  trainable {type(adapter.model).__name__}: {trainable / 1e9:.2f}B parameters; {what}",
        f"  one training forward: {rows} rows x {tokens} tokens through {layers} layers of "
        f"width {hidden}; {workers} worker(s); gradient checkpointing "
        f"{'on' if checkpointing else 'off'}",
        *est.lines(),
    ]
    for gib in [gpu_gib] if gpu_gib is not None else list(GPU_SIZES):
        lines.extend(_fit_lines(gib, est, kwargs, recipe, rows, cfg))
        if auto:
            lines.append(_auto_line(gib, est, kwargs, cfg))
    lines.append("  (an estimate: omni_adapters.memory's formula; only a GPU run measures it)")
    return lines
