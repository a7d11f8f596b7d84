"""Weight versions, waiting, aborts, failures and closing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diffusion_rollout import (
    EmbeddedEngine,
    EngineClosed,
    RequestAborted,
    RolloutRequest,
    SamplingParams,
    VersionMismatchError,
)

P = SamplingParams(height=16, width=16, num_steps=4, sde_window_size=2, output="latent")
NEW = {"proj_out.bias": torch.full((4,), 0.25)}


class Gate:
    """Makes the toy's velocity block on its first call until released."""

    def __init__(self, toy):
        self.started, self.release = threading.Event(), threading.Event()
        orig = toy.velocity

        def velocity(*a, **k):
            self.started.set()
            assert self.release.wait(10)
            return orig(*a, **k)

        toy.velocity = velocity


def test_wave_in_flight_finishes_on_old_weights(toy):
    req = RolloutRequest("x", 3, P, "a")
    with EmbeddedEngine(toy) as ref_engine:
        (ref_old,) = ref_engine.generate_many([req])
    gate = Gate(toy)
    engine = EmbeddedEngine(toy)
    fut = engine.submit(req)
    assert gate.started.wait(10)
    done = threading.Event()
    updater = threading.Thread(target=lambda: (engine.update_weights(NEW, 1), done.set()))
    updater.start()
    time.sleep(0.05)
    assert not done.is_set()  # the update waits for the wave in flight
    gate.release.set()
    traj = fut.result(10)
    updater.join(10)
    assert done.is_set() and engine.version == 1
    assert traj.version == 0 and torch.equal(traj.final_latent, ref_old.final_latent)
    (after,) = engine.generate_many([RolloutRequest("x", 3, P, "b")])
    assert after.version == 1 and not torch.equal(after.final_latent, ref_old.final_latent)
    engine.close()


def test_request_for_future_version_waits_for_update(toy):
    with EmbeddedEngine(toy, version_timeout_s=10) as engine:
        pinned = engine.submit(RolloutRequest("x", 1, P.replace(weights_version=2), "p"))
        free = engine.submit(RolloutRequest("x", 1, P, "f"))
        assert free.result(10).version == 0  # unpinned requests are not held up
        time.sleep(0.05)
        assert not pinned.done()
        engine.update_weights(NEW, version=2)
        assert pinned.result(10).version == 2


def test_request_for_future_version_times_out_clearly(toy):
    with EmbeddedEngine(toy, version_timeout_s=0.1) as engine:
        fut = engine.submit(RolloutRequest("x", 1, P.replace(weights_version=5), "late"))
        with pytest.raises(VersionMismatchError, match=r"version 5.*within 0.1 s"):
            fut.result(10)
        assert engine.stats()["version_errors"] == 1


def test_request_for_old_version_fails_at_once(toy):
    with EmbeddedEngine(toy, version=3) as engine:
        fut = engine.submit(RolloutRequest("x", 1, P.replace(weights_version=2), "old"))
        with pytest.raises(VersionMismatchError, match="engine is at version 3"):
            fut.result(10)
        ok = engine.submit(RolloutRequest("x", 1, P.replace(weights_version=3), "cur"))
        assert ok.result(10).version == 3


def test_pinned_and_unpinned_requests_share_a_wave(toy):
    with EmbeddedEngine(toy, version=1) as engine:
        engine.generate_many(
            [
                RolloutRequest("x", i, P.replace(weights_version=1 if i % 2 else None))
                for i in range(6)
            ]
        )
        assert engine.stats()["waves"] == 1


def test_update_weights_validates(toy):
    with EmbeddedEngine(toy) as engine:
        with pytest.raises(ValueError, match="version"):
            engine.update_weights(NEW, version=-1)
        with pytest.raises(ValueError, match="tensors"):
            engine.update_weights({"a": 1.0}, version=1)
        with pytest.raises(KeyError, match="nope"):
            engine.update_weights({"nope": torch.zeros(1)}, version=1)
        assert engine.version == 0  # a failed load keeps the old version


def test_max_wait_ms_collects_stragglers(toy):
    with EmbeddedEngine(toy, max_num_seqs=8, max_wait_ms=1000) as engine:  # room for load
        futs = [engine.submit(RolloutRequest("x", 0, P, "first"))]
        time.sleep(0.05)
        futs += [engine.submit(RolloutRequest("x", i, P, f"s{i}")) for i in range(1, 4)]
        for f in futs:
            f.result(10)
        st = engine.stats()
    assert st["waves"] == 1 and st["mean_rows_per_forward"] == 4
    assert st["mean_queue_wait_s"] > 0.1


def test_full_wave_does_not_wait(toy):
    with EmbeddedEngine(toy, max_num_seqs=2, max_wait_ms=5000) as engine:
        t0 = time.monotonic()
        engine.generate_many([RolloutRequest("x", i, P) for i in range(2)])
        assert time.monotonic() - t0 < 4


def test_abort_and_close(toy):
    gate = Gate(toy)
    engine = EmbeddedEngine(toy)
    running = engine.submit(RolloutRequest("x", 1, P, "run"))
    assert gate.started.wait(10)
    queued = engine.submit(RolloutRequest("x", 2, P.replace(height=32), "q"))
    other = engine.submit(RolloutRequest("x", 3, P.replace(height=32), "q2"))
    assert engine.abort("q") == 1
    with pytest.raises(RequestAborted, match="'q'"):
        queued.result(1)
    threading.Timer(0.1, gate.release.set).start()
    engine.close()  # waits for the wave in flight
    assert running.result(1).request_id == "run"
    with pytest.raises(EngineClosed):
        other.result(1)
    with pytest.raises(EngineClosed):
        engine.submit(RolloutRequest("x", 4, P))


def test_denoiser_error_fails_the_wave_not_the_engine(toy):
    orig = toy.velocity
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return orig(*a, **k)

    toy.velocity = flaky
    with EmbeddedEngine(toy) as engine:
        with pytest.raises(RuntimeError, match="boom"):
            engine.generate_many([RolloutRequest("x", 1, P)])
        (t,) = engine.generate_many([RolloutRequest("x", 1, P)])
        assert t.final_latent is not None and engine.stats()["failed"] == 1


def test_cancelled_future_is_skipped(toy):
    gate = Gate(toy)
    with EmbeddedEngine(toy) as engine:
        first = engine.submit(RolloutRequest("x", 1, P, "a"))
        assert gate.started.wait(10)
        second = engine.submit(RolloutRequest("x", 2, P.replace(height=32), "b"))
        assert second.cancel()
        gate.release.set()
        first.result(10)
        engine.generate_many([RolloutRequest("x", 3, P)])
        assert engine.stats()["requests"] == 2


def test_bad_inputs(toy):
    with pytest.raises(ValueError, match="max_num_seqs"):
        EmbeddedEngine(toy, max_num_seqs=0)
    with pytest.raises(TypeError, match="encode"):
        EmbeddedEngine(object())
    with EmbeddedEngine(toy) as engine, pytest.raises(TypeError, match=r"requests\[0\]"):
        engine.submit_many([{"prompt": "x"}])
