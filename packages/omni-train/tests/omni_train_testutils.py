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


def minimal_recipe(run_dir, model, sections: dict | None = None, **trainer) -> dict:
    """A small trainable recipe dict on a tiny SD3 at `model` (brightness reward). `sections`
    adds to or overrides the keys of whole sections (``{"rollout": {"noise_level": 0.8}}``),
    `trainer` the trainer section's."""
    recipe = {
        "experiment": "test",
        "model": {"path": str(model), "tiny": "sd3"},
        "data": {"prompts": ["a red square", "a blue circle"], "prompts_per_step": 2},
        "rollout": {
            "n": 4,
            "height": 32,
            "width": 32,
            "num_steps": 4,
            "sde_window_size": 2,
            "sde_window_range": [0, 2],
        },
        "reward": {"name": "brightness"},
        "trainer": {
            "steps": 2,
            "output_dir": str(run_dir),
            "progress": False,
            "sample_every": 0,
            **trainer,
        },
    }
    for name, keys in (sections or {}).items():
        recipe.setdefault(name, {}).update(keys)
    return recipe


def without_timings(rows: list[dict]) -> list[dict]:
    """Metric rows without the wall-clock ones (`timing/`, `perf/`): what two runs of the same
    recipe and seed must agree on bit for bit."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]
