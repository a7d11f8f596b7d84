"""`omni-train validate`: check a recipe without running it."""

from __future__ import annotations

import inspect
from pathlib import Path

from .algorithms import algorithm
from .recipe import Recipe, RecipeError, unknown_name


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
    names = (
        [("reward.name", recipe.reward.name)]
        if recipe.reward.name is not None
        else [(f"reward.terms[{i}].name", t.name) for i, t in enumerate(recipe.reward.terms or [])]
    )
    for key, name in names:
        if name not in known:
            raise RecipeError(unknown_name(key, "reward", name, known))
    path = Path(recipe.model.path)
    has_model = (path / "model_index.json").is_file() or (path / "config.json").is_file()
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
