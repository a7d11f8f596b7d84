"""The policy a recipe trains: the model folder (a tiny model is built on first use), the
adapter with LoRA or full fine-tuning set up, and its optimizer. Every backend and worker
builds the policy with these functions, so they all train the same parameters."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .errors import TrainError
from .recipe import Recipe, RecipeError

__all__ = [
    "build_optimizer",
    "ensure_model",
    "is_saved_model",
    "load_policy",
    "load_trainable",
    "quiet_libraries",
    "set_full_trainable",
]


def is_saved_model(path: Path) -> bool:
    """A diffusers pipeline folder or a transformers model folder."""
    return (path / "model_index.json").is_file() or (path / "config.json").is_file()


def ensure_model(recipe: Recipe) -> Path:
    """The model folder; builds the tiny model there first when `model.tiny` is set.

    A tiny model cached by an older build (its `tiny_build.json` names another family, seed
    or builder revision) is rebuilt in place; a folder without that stamp is used as is."""
    m = recipe.model
    path = Path(m.path)
    has_config = is_saved_model(path)
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
            has_config = is_saved_model(path)
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
        if not is_saved_model(path):
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


def load_policy(recipe: Recipe, *, device: str | None = None) -> Any:
    """The adapter of `model.path` with LoRA added (`lora.*`, A matrices seeded by
    `lora.init_seed`) or full fine-tuning set up, and the EMA copy when
    `optimizer.ema_decay > 0`. Errors name the recipe key."""
    from omni_adapters import from_pretrained

    r = recipe
    path = ensure_model(r)
    dev = device or r.model.device
    if dev.startswith("cuda") and torch.cuda.is_available():
        dev = "cuda"  # a Ray actor sees its own GPU as device 0
    try:
        adapter = from_pretrained(path, dtype=r.model.dtype, device=dev, **r.model.options)
    except (ValueError, FileNotFoundError) as exc:
        raise TrainError(f"model.path: cannot load {path}: {exc}") from None
    if r.lora.enabled:
        torch.manual_seed(r.lora.init_seed)
        try:
            adapter.add_lora(
                r.lora.rank,
                r.lora.alpha,
                target_modules=r.lora.target_modules,
                dropout=r.lora.dropout,
            )
        except ValueError as exc:
            raise TrainError(f"lora: {exc}") from None
    else:
        set_full_trainable(adapter, r)
    if hasattr(adapter, "latent_shape"):  # a size the model cannot take fails here, by key
        try:
            adapter.latent_shape(r.sampling_params())
        except ValueError as exc:
            raise RecipeError(f"rollout.{exc} for {type(adapter).__name__}") from None
    if r.optimizer.ema_decay > 0:
        adapter.add_adapter_copy("default", "ema")
    if not adapter.named_trainable_parameters():
        raise TrainError("nothing to train: the model has no trainable parameters")
    return adapter


def build_optimizer(params: list[torch.nn.Parameter], recipe: Recipe) -> torch.optim.Optimizer:
    """AdamW on ``params`` with the recipe's `optimizer.*` settings."""
    o = recipe.optimizer
    return torch.optim.AdamW(
        params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
    )


def _like(target: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``whole`` on ``target``'s device and dtype, sharded like it when it is an FSDP DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        src = whole.to(target.device_mesh.device_type, target.dtype)
        return distribute_tensor(src, target.device_mesh, target.placements)
    return whole.to(target.device, target.dtype)


def load_trainable(
    adapter: Any, params_named: dict[str, Any], trainable: dict[str, Tensor], recipe: Recipe
) -> None:
    """Copy checkpointed trainable tensors (and ``ema/`` ones) into the policy; a TrainError
    names the keys that do not match."""
    ema = {k.removeprefix("ema/"): v for k, v in trainable.items() if k.startswith("ema/")}
    own = {k: v for k, v in trainable.items() if not k.startswith("ema/")}
    missing = sorted(set(params_named) - set(own))
    unknown = sorted(set(own) - set(params_named))
    if missing or unknown:
        raise TrainError(
            f"the checkpoint does not match the model: missing {missing[:3]}, unexpected "
            f"{unknown[:3]} (was the recipe's model or lora changed?)"
        )
    with torch.no_grad():
        for k, p in params_named.items():
            p.copy_(_like(p, own[k]))
        if recipe.optimizer.ema_decay > 0:
            if not ema:
                raise TrainError("the checkpoint has no EMA weights (optimizer.ema_decay > 0)")
            for k, t in adapter.adapter_state("ema").items():
                t.copy_(_like(t, ema[k]))
