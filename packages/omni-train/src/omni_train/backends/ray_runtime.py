"""The Ray runtime environment of every Ray job omni-train starts (its own Ray backend's and the
verl hand-off's), in a module of its own so that both use it without importing each other.

Ray starts its worker processes at niceness 15, so that its own daemons stay responsive; in our
jobs the workers are the training itself, and at 15 every other process on the machine comes
first (beside two busy loops on 2 cores, two FSDP ranks got ~4 % of a core each and a tiny
update did not finish in 10 minutes). `RAY_worker_niceness` is an increment on the raylet's
niceness, which a local cluster inherits from the driver: 0 keeps the driver's priority (a
driver at nice 5 gave its workers 5, and 19 without this). Ray's job supervisor sets the same
variable to 0 for its own actor.
"""

from __future__ import annotations

from typing import Any

__all__ = ["WORKER_RUNTIME_ENV"]

#: `runtime_env` for `ray.init`: the job's workers run at the driver's priority (docstring)
WORKER_RUNTIME_ENV: dict[str, Any] = {"env_vars": {"RAY_worker_niceness": "0"}}
