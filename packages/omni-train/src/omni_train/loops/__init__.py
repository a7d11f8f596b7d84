"""The training loops, one per model type, written out top to bottom.

- `DiffusionLoop` (`loops/diffusion.py`): rollout -> reward -> advantages -> update ->
  weight sync -> record, for every diffusion algorithm of `omni_train.algorithms`.
- `OmniLoop` (`loops/omni.py`): the same for an autoregressive thinker (GSPO / GRPO).

They talk to a backend only through its `omni_train.ports.Ports`.
"""

from .diffusion import DiffusionLoop
from .omni import OmniLoop
from .run import RUN_OUTPUTS, RunFolder, clear_run_dir
from .schedule import (
    CoreShare,
    PrefetchRollout,
    SyncRollout,
    free_cores,
    launchable,
    staleness_stats,
)

__all__ = [
    "RUN_OUTPUTS",
    "CoreShare",
    "DiffusionLoop",
    "OmniLoop",
    "PrefetchRollout",
    "RunFolder",
    "SyncRollout",
    "clear_run_dir",
    "free_cores",
    "launchable",
    "staleness_stats",
]
