"""`omni-train validate`: check a recipe without running it."""

from __future__ import annotations

from pathlib import Path

from .recipe import Recipe, RecipeError, unknown_name


def validate_recipe(recipe: Recipe) -> list[str]:
    """Checks that need the other packages' registries (cheap: nothing is loaded).

    Returns info lines; raises `RecipeError` naming the key on the first problem.
    """
    from omni_algos.losses import LOSSES
    from omni_rewards import available_rewards

    info = []
    if recipe.algorithm.name not in LOSSES:
        raise RecipeError(unknown_name("algorithm.name", "loss", recipe.algorithm.name, LOSSES))
    known = set(available_rewards())
    names = (
        [("reward.name", recipe.reward.name)]
        if recipe.reward.name is not None
        else [(f"reward.terms[{i}].name", t.name) for i, t in enumerate(recipe.reward.terms or [])]
    )
    for key, name in names:
        if name not in known:
            raise RecipeError(unknown_name(key, "reward", name, known))
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
    if recipe.data.file is not None and not Path(recipe.data.file).expanduser().is_file():
        info.append(f"data.file: {recipe.data.file} not found here (needed when the recipe runs)")
    b = recipe.data.prompts_per_step * recipe.rollout.n
    info.append(
        f"{recipe.experiment}: {recipe.trainer.steps} steps x {b} samples "
        f"({recipe.data.prompts_per_step} prompts x n={recipe.rollout.n}), "
        f"loss {recipe.algorithm.name}, output {recipe.output_dir()}"
    )
    return info
