"""diffusion_rollout: request-batched rollout engine for diffusion RL.

Compatible requests (equal ``SamplingParams.compat_key()``) share one transformer forward;
every request draws its noise from its own generator, so its trajectory is the one it would
have had alone.
"""

from .client import RolloutClient
from .engine import EmbeddedEngine
from .params import OUTPUTS, SDE_KINDS, RolloutRequest, SamplingParams
from .types import (
    Denoiser,
    EngineClosed,
    RequestAborted,
    Trajectory,
    VersionMismatchError,
    stack_conditions,
)
from .vllm_backend import VllmOmniEngine

__all__ = [
    "OUTPUTS",
    "SDE_KINDS",
    "Denoiser",
    "EmbeddedEngine",
    "EngineClosed",
    "RequestAborted",
    "RolloutClient",
    "RolloutRequest",
    "SamplingParams",
    "Trajectory",
    "VersionMismatchError",
    "VllmOmniEngine",
    "stack_conditions",
]

__version__ = "0.1.0"
