"""`omni-train validate`: check a recipe without running it."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

from .algorithms import algorithm
from .recipe import Recipe, RecipeError, unknown_name


def _prompt_sources(recipe: Recipe) -> list[tuple[str, list[str]]]:
    """The recipe's training and validation prompts that can be read now."""
    from .data import read_data_file

    d = recipe.data
    out: list[tuple[str, list[str]]] = []
    if d.prompts is not None:
        out.append(("data.prompts", list(d.prompts)))
    for key, path in (("data.file", d.file), ("data.val_file", d.val_file)):
        if path is not None and Path(path).expanduser().is_file():
            out.append((key, [row.prompt for row in read_data_file(path, key)]))
    if d.val_prompts:
        out.append(("data.val_prompts", list(d.val_prompts)))
    return out


def _check_extras(recipe: Recipe) -> None:
    """Optional packages the recipe needs, found now rather than after minutes of setup."""
    needs: list[tuple[str, str, str]] = []  # (the key that needs it, module, pip extra)
    if "tensorboard" in recipe.trainer.report_to:
        needs.append(("trainer.report_to: tensorboard", "tensorboard", "omni-train[tensorboard]"))
    if "wandb" in recipe.trainer.report_to:
        needs.append(("trainer.report_to: wandb", "wandb", "omni-train[wandb]"))
    if recipe.trainer.backend == "ray":
        needs.append(("trainer.backend: ray", "ray", "omni-train[ray]"))
    if recipe.trainer.backend == "verl":
        needs.append(("trainer.backend: verl", "verl", "omni-train[verl]"))
    if recipe.rollout.backend == "http":
        needs.append(("rollout.backend: http", "httpx", "diffusion-rollout[server]"))
    if recipe.rollout.backend == "vllm-omni":
        needs.append(("rollout.backend: vllm-omni", "vllm_omni", "diffusion-rollout[vllm-omni]"))
    for key, module, extra in needs:
        if importlib.util.find_spec(module) is None:
            raise RecipeError(f"{key} needs the python package {module!r}: pip install '{extra}'")


def validate_recipe(recipe: Recipe) -> list[str]:
    """Checks that need the other packages' registries (cheap: nothing is loaded).

    `Recipe.check` has already refused what the algorithm table says cannot run. Returns info
    lines; raises `RecipeError` naming the key on the first problem."""
    from omni_algos.losses import LOSSES
    from omni_rewards import available_rewards

    info = []
    row = algorithm(recipe.algorithm.name)
    loss = LOSSES[row.loss]
    params = inspect.signature(loss).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key in recipe.algorithm.options:
        if not takes_any and key not in params:
            raise RecipeError(
                f"algorithm.options.{key}: the {row.name} loss ({row.loss}) has no option "
                f"{key!r}; it takes {', '.join(k for k in params if params[k].default is not inspect.Parameter.empty)}"
            )
    known = set(available_rewards())
    r = recipe.reward
    names = (
        [("reward", r.name, r.options)]
        if r.name is not None
        else [(f"reward.terms[{i}]", t.name, t.options) for i, t in enumerate(r.terms or [])]
    )
    for key, name, _ in names:
        if name not in known:
            raise RecipeError(unknown_name(f"{key}.name", "reward", name, known))
    if not recipe.is_omni():  # what the reward reads from each prompt, checked now
        from omni_rewards import check_prompts

        for source, prompts in _prompt_sources(recipe):
            for key, name, options in names:
                bad = check_prompts(name, prompts, options)
                if bad:
                    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                    raise RecipeError(f"{key}.name: {name} cannot score {source}: {bad[0]}{more}")
    _check_extras(recipe)
    from omni_adapters import is_saved_model

    path = Path(recipe.model.path)
    has_model = is_saved_model(path)
    if recipe.model.tiny is not None:
        from omni_adapters import FAMILY_MODULES

        if recipe.model.tiny not in FAMILY_MODULES:
            raise RecipeError(
                unknown_name("model.tiny", "family", recipe.model.tiny, FAMILY_MODULES)
            )
        if not has_model:
            info.append(f"model: tiny {recipe.model.tiny} will be built at {path} on first run")
    elif not has_model:
        info.append(f"model.path: {path} not found here (needed when the recipe runs)")
    if has_model:  # the saved model's own class says which loop it needs
        from omni_adapters import adapter_for, read_architecture
        from omni_adapters.thinker import ThinkerAdapter

        try:
            cls = adapter_for(read_architecture(path))
        except (ValueError, KeyError, FileNotFoundError) as exc:
            raise RecipeError(f"model.path: {path}: {exc}") from None
        is_thinker = issubclass(cls, ThinkerAdapter)
        if is_thinker != (row.model == "omni"):
            kind = "an autoregressive (omni)" if is_thinker else "a diffusion"
            raise RecipeError(
                f"algorithm.name: {row.name} trains {row.model} models, but model.path {path} "
                f"is {kind} model ({cls.__name__})"
            )
    if recipe.data.file is not None and not Path(recipe.data.file).expanduser().is_file():
        info.append(f"data.file: {recipe.data.file} not found here (needed when the recipe runs)")
    b = recipe.data.prompts_per_step * recipe.rollout.n
    info.append(
        f"{recipe.experiment}: {recipe.trainer.steps} steps x {b} samples "
        f"({recipe.data.prompts_per_step} prompts x n={recipe.rollout.n}), "
        f"{row.name} ({row.kind} update, loss {row.loss}) on {recipe.trainer.backend}, "
        f"output {recipe.output_dir()}"
    )
    return info


def dry_run(recipe: Recipe) -> str:
    """Run one step of the recipe into a temporary folder; a one-line summary."""
    import tempfile

    from .recipe import recipe_from_dict
    from .train import train

    with tempfile.TemporaryDirectory(prefix="omni-dry-run-") as tmp:
        data = recipe.model_dump(mode="json")
        data["trainer"].update(
            steps=1, output_dir=tmp, sample_every=0, val_every=0, save_every=0, report_to=[]
        )
        (row,) = train(recipe_from_dict(data))
    return f"dry run: one step ran, reward {row['reward/mean']:.4f}, {row['timing/step_s']:.1f} s"
