"""trainer.mode: async: the rollout of step k+1 overlaps the update of step k, staleness is
bounded by trainer.max_staleness and reported, stale samples get the rollout correction."""

from __future__ import annotations

import numpy as np
import pytest

from omni_train.backends.async_mode import launchable, staleness_stats
from omni_train.errors import TrainError
from omni_train.recipe import recipe_from_dict

ray = pytest.importorskip("ray")


def recipe(tmp, **trainer):
    return recipe_from_dict(
        {
            "experiment": "async",
            "model": {"path": str(tmp / "model"), "tiny": "sd3"},
            "data": {"prompts": ["a red square", "a blue circle"], "prompts_per_step": 2},
            "rollout": {
                "n": 4,
                "height": 32,
                "width": 32,
                "num_steps": 4,
                "sde_window_size": 2,
                "sde_window_range": [0, 2],
                "noise_level": 0.8,
            },
            "reward": {"name": "color_match"},
            "algorithm": {"name": "flow_grpo", "clip_range": 0.2},
            "optimizer": {"lr": 1e-2},
            "trainer": {
                "steps": 4,
                "output_dir": str(tmp / "run"),
                "progress": False,
                "threads": 1,
                "sample_every": 0,
                "backend": "ray",
                "num_workers": 1,
                "mode": "async",
                **trainer,
            },
        }
    )


def test_launch_rule_bounds_staleness():
    # simulate the schedule: rollout j may start when j - version <= s; step j trains at j
    for s in range(4):
        version, nxt, seen = 0, 0, []
        launched = {}
        for step in range(10):
            while launchable(nxt, version, s, 10):
                launched[nxt] = version
                nxt += 1
            seen.append(step - launched.pop(step))
            version = step + 1
        assert max(seen) == min(s, 9) and min(seen) >= 0
    assert not launchable(5, 5, 0, 5)  # never past the last step


def test_staleness_stats():
    assert staleness_stats(3, [3, 2, 2, 3]) == {
        "async/staleness_max": 1.0,
        "async/staleness_mean": 0.5,
    }
    with pytest.raises(TrainError, match="future"):
        staleness_stats(1, [2])


def test_async_overlap_and_bounded_staleness(tmp_path):
    from omni_train.backends.async_mode import AsyncRayTrainer
    from omni_train.logger import MetricsLogger

    if not ray.is_initialized():  # shared with test_ray_backend when run together
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tr = None
    try:
        tr = AsyncRayTrainer(recipe(tmp_path, max_staleness=1), tmp_path / "run")
        tr.setup()
        logger = MetricsLogger(tmp_path / "m")
        rows = [tr.train_step(step, logger) for step in range(3)]
        logger.close()
        tl = tr.timelines()
    finally:
        if tr is not None:
            tr.close()
    stale = [r["async/staleness_max"] for r in rows]
    assert max(stale) <= 1 and stale[0] == 0 and stale[1] == 1 and stale[2] == 1
    assert rows[1]["rollout/version"] == 0  # step 1 was rolled out before update 0 landed
    assert all(0 <= r["async/staleness_mean"] <= 1 for r in rows)
    assert "async/correction_is_weight_mean" in rows[1]  # off-policy samples were corrected
    assert "async/correction_is_weight_mean" not in rows[0]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert all(r["rollout/forwards"] >= 1 and r["rollout/rows_per_forward"] > 1 for r in rows)
    upd = {tag: (a, b) for tag, a, b in tl["actor"]}
    gen = {tag: (a, b) for tag, a, b in tl["rollout"]}
    overlaps = []
    for k in (0, 1, 2):
        (u0, u1), (g0, g1) = upd[f"update{k}"], gen[f"s{k + 1}"]
        # sync mode would start rollout k+1 only after update k and the weight sync
        assert g0 < u1, f"rollout s{k + 1} waited for update {k}: {tl}"
        overlaps.append(min(u1, g1) - max(u0, g0))
    assert max(overlaps) > 0, f"no rollout ran during an update: {tl}"
