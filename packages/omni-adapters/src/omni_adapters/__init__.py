"""omni_adapters: model families behind one interface for RL post-training.

``from_pretrained(path)`` picks the adapter from the saved model's own config;
``tiny.build(family, path)`` writes an architecture-faithful tiny random model.
"""

from . import tiny
from .base import (
    ADAPTERS,
    FAMILY_MODULES,
    OmniModelBase,
    adapter_for,
    from_pretrained,
    is_saved_model,
    read_architecture,
    register_adapter,
    weights_checksum,
)
from .diffusion import DiffusionAdapter
from .thinker import ThinkerAdapter

__all__ = [
    "ADAPTERS",
    "FAMILY_MODULES",
    "DiffusionAdapter",
    "OmniModelBase",
    "ThinkerAdapter",
    "adapter_for",
    "from_pretrained",
    "is_saved_model",
    "read_architecture",
    "register_adapter",
    "tiny",
    "weights_checksum",
]
__version__ = "0.1.0"
