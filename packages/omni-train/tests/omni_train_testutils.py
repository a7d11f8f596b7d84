"""Helpers shared by omni-train's tests (imported by name: conftest puts this folder on
sys.path)."""

from __future__ import annotations


def local_loop(recipe, run_dir):
    """A diffusion loop on the local backend's ports (close with ``loop.ports.close()``)."""
    from omni_train.backends import make_ports
    from omni_train.loops import DiffusionLoop

    return DiffusionLoop(recipe, make_ports(recipe), run_dir)


def rollout_and_score(loop, step: int = 0):
    """Step `step`'s trajectories and rewards, as the loop makes them."""
    trajs = loop.ports.rollout.generate_many(loop.requests_for(step))
    rewards, _, _ = loop.score(trajs, step)
    return trajs, rewards
