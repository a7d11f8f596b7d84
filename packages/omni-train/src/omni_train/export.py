"""`omni-train export RUN --format diffusers|peft|merged`: a run's trained weights for use
elsewhere.

- ``peft``: the LoRA as a peft adapter folder (`adapter_model.safetensors`,
  `adapter_config.json`), for `peft` / `PeftModel.from_pretrained` on the base component.
- ``diffusers``: `pytorch_lora_weights.safetensors` with the LoRA config in its metadata, for a
  diffusers pipeline's `load_lora_weights(folder)`.
- ``merged``: a copy of the model folder (a diffusers pipeline) whose trainable component has
  the LoRA merged into its weights, ``W + (alpha / r) B A`` (peft's merge), saved with the
  component's own `save_pretrained`: it loads like the base model and samples what the trained
  run sampled (tests/test_export.py), with no LoRA layers left.

Every export reads the checkpoint only (safetensors and JSON) and never changes the run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .checkpoint import latest_checkpoint, load_checkpoint
from .errors import TrainError
from .recipe import load_recipe

__all__ = ["export_run"]


def _checkpoint(run: Path, step: int | None) -> Path:
    if step is not None:
        ck = run / "checkpoint" / f"step_{step:04d}"
        if not (ck / "state.json").is_file():
            raise TrainError(f"export --checkpoint: {ck} is not a checkpoint")
        return ck
    ck = latest_checkpoint(run / "checkpoint")
    if ck is None:
        raise TrainError(f"export: {run} has no complete checkpoint")
    return ck


def export_run(
    run: str | Path, fmt: str, out: str | Path | None = None, step: int | None = None
) -> Path:
    """Write the trained weights of `run` (its latest checkpoint, or `step`'s) as `fmt`."""
    run = Path(run)
    if not (run / "recipe.yaml").is_file():
        raise TrainError(f"export: {run} is not a run folder (no recipe.yaml)")
    ck = _checkpoint(run, step)
    dest = Path(out) if out is not None else run / "export" / fmt
    if dest.exists() and any(dest.iterdir()):
        raise TrainError(f"export --out: {dest} is not empty")
    dest.mkdir(parents=True, exist_ok=True)
    lora = ck / "lora"
    if fmt == "peft":
        if not (lora / "adapter_model.safetensors").is_file():
            raise TrainError(f"export: {ck} holds no LoRA (lora.enabled was false)")
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copy2(lora / name, dest / name)
        return dest
    if fmt == "diffusers":
        src = lora / "pytorch_lora_weights.safetensors"
        if not src.is_file():
            raise TrainError(f"export: {ck} holds no diffusers LoRA file (diffusion models only)")
        shutil.copy2(src, dest / src.name)
        return dest
    if fmt != "merged":
        raise TrainError(f"export --format: unknown format {fmt!r}; known: diffusers, peft, merged")
    return _merged(run, ck, dest)


def _merged(run: Path, ck: Path, dest: Path) -> Path:
    """The model folder with the trained LoRA (or full weights) merged into its component."""
    import torch

    from .models import ensure_model, load_policy, load_trainable

    recipe = load_recipe(run / "recipe.yaml", [f"trainer.output_dir={run}"])
    src = ensure_model(recipe)
    if not (src / "model_index.json").is_file():
        raise TrainError(
            f"export --format merged: {src} is not a diffusers pipeline folder; export the "
            "adapter with --format peft and merge it with peft's merge_and_unload"
        )
    adapter = load_policy(recipe)
    load_trainable(
        adapter, adapter.named_trainable_parameters(), load_checkpoint(ck).trainable, recipe
    )
    component = adapter.trainable_component
    model = adapter.model
    with torch.no_grad():
        if recipe.lora.enabled:
            from peft.tuners.lora import LoraLayer

            for module in model.modules():
                if isinstance(module, LoraLayer):
                    module.merge(adapter_names=["default"])
    state = {
        k.replace(".base_layer.", "."): v
        for k, v in model.state_dict().items()
        if "lora_" not in k and ".ema." not in k
    }
    shutil.copytree(src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(component))
    cls = type(adapter.components[component])  # peft injected its layers in place
    fresh = cls.from_pretrained(src / component)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise TrainError(
            f"export --format merged: the merged {component} does not match {cls.__name__}: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    fresh.save_pretrained(dest / component)
    (dest / "omni_export.json").write_text(
        json.dumps({"run": str(run), "checkpoint": ck.name, "merged_component": component})
    )
    return dest
