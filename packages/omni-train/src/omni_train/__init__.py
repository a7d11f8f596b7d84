"""omni_train: recipes and the RL loop for diffusion and omni models.

Run a recipe::

    from omni_train import load_recipe, train
    rows = train(load_recipe("recipes/quickstart.yaml", ["trainer.steps=2"]))

Pieces a custom trainer can reuse: the algorithm table (`ALGORITHMS`), the update steps
(`run_update` and the batch builders in `omni_train.updates`), the loops (`DiffusionLoop`,
`OmniLoop`) and the ports they drive (`make_ports`, `Ports`).
"""

from .algorithms import ALGORITHMS, Algorithm, algorithm
from .backends import make_ports
from .errors import NonFiniteError, TrainError
from .loops import DiffusionLoop, OmniLoop
from .ports import Ports
from .recipe import Recipe, RecipeError, load_recipe, recipe_from_dict
from .train import resume, train
from .updates import (
    LocalCollective,
    UpdateContext,
    UpdatePlan,
    UpdateSettings,
    make_update_plans,
    pair_batch,
    replay_batch,
    run_update,
    sample_batch,
    token_batch,
)

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "DiffusionLoop",
    "LocalCollective",
    "NonFiniteError",
    "OmniLoop",
    "Ports",
    "Recipe",
    "RecipeError",
    "TrainError",
    "UpdateContext",
    "UpdatePlan",
    "UpdateSettings",
    "algorithm",
    "load_recipe",
    "make_ports",
    "make_update_plans",
    "pair_batch",
    "recipe_from_dict",
    "replay_batch",
    "resume",
    "run_update",
    "sample_batch",
    "token_batch",
    "train",
]
