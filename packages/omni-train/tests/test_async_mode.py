"""trainer.mode: async, on any backend: the rollout of step k+1 overlaps the update of step k,
staleness is bounded by trainer.max_staleness and reported, stale samples get the correction."""

from __future__ import annotations

import time

import numpy as np
import pytest
from omni_train_testutils import minimal_recipe, without_timings

from omni_train.backends import make_ports
from omni_train.errors import TrainError
from omni_train.loops import DiffusionLoop, launchable, staleness_stats
from omni_train.recipe import recipe_from_dict


def recipe(tmp, model, rollout_backend="embedded", **trainer):
    sections = {
        "rollout": {"noise_level": 0.8, "backend": rollout_backend},
        "algorithm": {"name": "flow_grpo", "clip_range": 0.2},
        "optimizer": {"lr": 1e-2},
    }
    trainer = {"steps": 3, "threads": 1, "mode": "async", "max_staleness": 1, **trainer}
    return recipe_from_dict(minimal_recipe(tmp / "run", model, sections, **trainer))


def test_launch_rule_bounds_staleness():
    for s in (0, 1, 2):
        version, nxt, seen = 0, 0, []
        for step in range(10):
            while launchable(nxt, version, s, 10):
                seen.append(nxt - version)
                nxt += 1
            version = step + 1
        assert max(seen) == s and min(seen) >= 0
    assert not launchable(5, 5, 0, 5)  # never past the last step


def test_staleness_stats():
    assert staleness_stats(3, [3, 2, 2, 3]) == {
        "async/staleness_max": 1.0,
        "async/staleness_mean": 0.5,
    }
    with pytest.raises(TrainError, match="future"):
        staleness_stats(1, [2])


def test_rollout_history_keeps_copies_of_the_versions_a_checkpoint_needs():
    import torch

    from omni_train.loops.schedule import RolloutHistory

    saves = {2, 4, 5}  # checkpoints after 2, 4 and 5 completed steps
    for s in (1, 2):
        history = RolloutHistory(s, lambda n: n in saves)
        live = {"w": torch.zeros(3)}  # a learner's export shares its parameters' storage
        for version in range(6):
            live["w"].fill_(float(version))
            history.add(live, version)
            if version in saves:  # the loop saves right after pushing version N = steps done
                held = history.for_checkpoint(version)
                assert sorted(held) == list(range(max(0, version - s), version))
                assert all(held[v]["w"].eq(float(v)).all() for v in held)
        # only what a checkpoint still to come could need, never more than s versions
        assert len(history.kept) <= s


def _timed_run(r, tmp):
    """Train with the ports' rollout and update wrapped to record (start, end) per step (the
    validation's rollouts, made on the loop's thread beside the prefetch, are not recorded)."""
    import threading

    ports = make_ports(r)
    spans: dict[str, list[tuple[float, float]]] = {"rollout": [], "update": []}
    validating: set[int] = set()  # threads inside the loop's validate()

    def timed(kind, fn):
        def wrapper(*args, **kwargs):
            t0 = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                if threading.get_ident() not in validating:
                    spans[kind].append((t0, time.monotonic()))

        return wrapper

    ports.rollout.generate_many = timed("rollout", ports.rollout.generate_many)
    ports.learner.update = timed("update", ports.learner.update)
    loop = DiffusionLoop(r, ports, tmp / "run")
    validate = loop.validate

    def validate_marked(step):
        validating.add(threading.get_ident())
        try:
            return validate(step)
        finally:
            validating.discard(threading.get_ident())

    loop.validate = validate_marked
    try:
        rows = loop.train()
    finally:
        ports.close()
    return rows, spans


def _check(rows, spans):
    # validation ran at step 0 (the baseline, beside the first prefetch) and after step 2
    assert "val/reward_mean" in rows[1] and np.isfinite(rows[1]["val/reward_mean"])
    stale = [r["async/staleness_max"] for r in rows]
    assert stale == [0.0, 1.0, 1.0]
    assert rows[1]["rollout/version"] == 0  # step 1 was rolled out before update 0 landed
    assert "correction/is_weight_mean" in rows[1]  # off-policy samples were corrected
    assert "correction/is_weight_mean" not in rows[0]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert all(r["rollout/forwards"] >= 1 for r in rows)
    # throughput over the rollout's own time, not over the loop's (near-zero) wait for it
    for r in rows:
        assert r["timing/rollout_busy_s"] > 0
        rate = r["rollout/rows"] / r["timing/rollout_busy_s"]
        assert r["perf/images_per_s"] == pytest.approx(rate, rel=1e-6)
    # rollout k+1 started before update k ended (sync mode would wait for the update)
    for k in (0, 1):
        (_, u1), (g0, _) = spans["update"][k], spans["rollout"][k + 1]
        assert g0 < u1, spans


def test_async_on_the_local_backend_overlaps(tmp_path, tiny_sd3):
    rows, spans = _timed_run(recipe(tmp_path, tiny_sd3, val_every=2), tmp_path)
    _check(rows, spans)


@pytest.mark.slow
def test_async_with_the_http_rollout_overlaps(tmp_path, tiny_sd3):
    """The prefetch thread rolls out on a `diffusion-rollout serve` (started by omni-train)
    while the loop's thread pushes the next version to it and validates through it."""
    r = recipe(tmp_path, tiny_sd3, rollout_backend="http", val_every=2)
    rows, spans = _timed_run(r, tmp_path)
    _check(rows, spans)
    assert [row["weights/version"] for row in rows] == [1, 2, 3]


@pytest.mark.slow
def test_async_on_ray_overlaps(ray_session, tmp_path, tiny_sd3):
    r = recipe(tmp_path, tiny_sd3, backend="ray", num_workers=1, val_every=2)
    rows, spans = _timed_run(r, tmp_path)
    _check(rows, spans)


def test_async_rollout_and_update_split_the_threads(tmp_path, tiny_sd3):
    """trainer.threads 2, async: the prefetch thread's waves run on 1 torch thread and the
    update beside them on the other, never 2 + 2 on the cores (PrefetchRollout)."""
    import threading

    import torch

    r = recipe(tmp_path, tiny_sd3, threads=2)
    ports = make_ports(r)
    seen: dict[str, list] = {"rollout": [], "update": []}

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            seen[kind].append((threading.current_thread().name, torch.get_num_threads()))
            return fn(*args, **kwargs)

        return wrapper

    ports.rollout.generate_many = counted("rollout", ports.rollout.generate_many)
    ports.learner.update = counted("update", ports.learner.update)
    try:
        rows = DiffusionLoop(r, ports, tmp_path / "run").train()
    finally:
        ports.close()
    assert all(np.isfinite(row["loss"]) for row in rows)
    assert seen["rollout"] and {n for _, n in seen["rollout"]} == {1}
    assert all(name.startswith("rollout-prefetch") for name, _ in seen["rollout"])
    # updates 0 and 1 ran beside the next rollout: 1 thread; the last one had none in flight
    assert [n for _, n in seen["update"]] == [1, 1, 2]
    assert torch.get_num_threads() == 2  # close() gave the caller its threads back


def test_free_cores_leaves_other_processes_their_share():
    from omni_train.loops import CoreShare, free_cores

    assert free_cores(2.0, 2.0, 2) == 2  # only we run: every core
    assert free_cores(0.1, 0.0, 4) == 4
    assert free_cores(8.6, 0.6, 2) == 1  # 8 busy threads elsewhere: one thread, never 0
    assert free_cores(3.0, 1.0, 4) == 2
    assert free_cores(50.0, 0.0, 8) == 1
    import torch

    before = torch.get_num_threads()
    try:
        share = CoreShare()
        n = share.update()
        assert 1 <= n <= share.cores and torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


def test_threads_auto_is_refused_where_it_does_not_apply(train_dict):
    from omni_train.recipe import RecipeError, recipe_from_dict

    d = train_dict()
    d["trainer"].update(threads="auto")
    assert recipe_from_dict(d).trainer.threads == "auto"  # local, sync: accepted
    d["trainer"].update(mode="async")
    with pytest.raises(RecipeError, match=r"trainer\.threads: `auto`"):
        recipe_from_dict(d)
    d["trainer"].update(mode="sync", threads=0)
    with pytest.raises(RecipeError, match=r"trainer\.threads"):
        recipe_from_dict(d)
    d["trainer"].update(threads="auto")
    d["model"]["device"] = "cuda"  # CoreShare measures CPU cores: nothing to follow on a GPU
    with pytest.raises(RecipeError, match=r"trainer\.threads: `auto`.*model\.device cuda"):
        recipe_from_dict(d)


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_an_async_run_resumed_repeats_the_uninterrupted_one(tmp_path, tiny_sd3, max_staleness):
    """The rollout of step j is launched on version max(0, j - max_staleness), so after N
    steps the next rollouts run on versions N - S .. N - 1, not on the checkpoint's version N:
    the checkpoint holds those too (`rollout/version_V.safetensors`), and the resumed run
    launches its first rollouts on them and ends with the uninterrupted run's metrics."""
    import shutil

    from omni_train import resume, train
    from omni_train.logger import read_metrics

    r = recipe(
        tmp_path,
        tiny_sd3,
        steps=5,
        save_every=2,
        keep_checkpoints=5,
        max_staleness=max_staleness,
        val_every=0,
    )
    whole = train(r)
    ck = tmp_path / "run" / "checkpoint" / "step_0002"
    held = sorted(p.name for p in (ck / "rollout").iterdir())
    assert held == [f"version_{v}.safetensors" for v in range(2 - max_staleness, 2)]
    run = tmp_path / "cut"
    shutil.copytree(tmp_path / "run", run)
    resume(run, checkpoint=2)
    rows = read_metrics(run / "metrics.jsonl")

    assert [r["rollout/version"] for r in rows] == [max(0, j - max_staleness) for j in range(5)]
    assert without_timings(rows) == without_timings(whole)
