"""omni_rewards: reward models for RL post-training of generative models.

The core (this module, `RewardInput`, `RewardOutput`, `load_reward`, the JPEG, brightness and
colour rewards, `MultiReward`) needs only numpy and Pillow. Model-backed rewards import their
dependencies when they are built; a missing one raises an error with the pip command.
"""

from __future__ import annotations

from . import audio as _audio  # noqa: F401 - registers the weight-free audio reward
from . import image as _image  # noqa: F401 - registers the core rewards
from .base import MissingDependencyError, Reward, RewardError, RewardLike, as_input
from .image import PALETTE, find_color
from .multi import MultiReward
from .prompt_checks import PROMPT_CHECKS, check_prompts, register_prompt_check
from .registry import ENTRY_POINT_GROUP, REWARDS, available_rewards, load_reward, register
from .types import RewardInput, RewardInputError, RewardOutput

__version__ = "0.1.0"

__all__ = [
    "ENTRY_POINT_GROUP",
    "PALETTE",
    "PROMPT_CHECKS",
    "REWARDS",
    "MissingDependencyError",
    "MultiReward",
    "Reward",
    "RewardError",
    "RewardInput",
    "RewardInputError",
    "RewardLike",
    "RewardOutput",
    "as_input",
    "available_rewards",
    "check_prompts",
    "find_color",
    "load_reward",
    "register",
    "register_prompt_check",
]
