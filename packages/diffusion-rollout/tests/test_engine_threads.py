"""Which thread computes: `generate_many` runs the waves in its caller's thread (one OpenMP
team per process), the non-blocking calls in the scheduler thread with ``threads`` torch
threads; one thread drives at a time, so waves never run concurrently."""

from __future__ import annotations

import threading

import pytest
import torch

from diffusion_rollout import EmbeddedEngine, RequestAborted, SamplingParams

P = SamplingParams(height=32, width=32, num_steps=4, sde_window_size=2, output="both")


def record_threads(toy, log: list) -> None:
    """Wrap the toy's velocity so each call logs (thread, torch threads, rows); counts how
    many calls overlap in time (``toy.max_concurrent``)."""
    inner = toy.velocity
    lock = threading.Lock()
    toy.active, toy.max_concurrent = 0, 0

    def velocity(latents, sigma, condition, params):
        with lock:
            toy.active += 1
            toy.max_concurrent = max(toy.max_concurrent, toy.active)
        try:
            log.append((threading.current_thread(), torch.get_num_threads(), latents.shape[0]))
            return inner(latents, sigma, condition, params)
        finally:
            with lock:
                toy.active -= 1

    toy.velocity = velocity


def scheduler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "diffusion-rollout-scheduler"]


def test_generate_many_runs_the_waves_in_the_calling_thread(toy, make_requests):
    log: list = []
    record_threads(toy, log)
    with EmbeddedEngine(toy, max_num_seqs=4) as engine:
        trajs = engine.generate_many(make_requests(10, P))
        assert not scheduler_threads()  # no second thread, so no second OpenMP team
    assert len(trajs) == 10 and all(t is not None for t in trajs)
    assert log and {t for t, _, _ in log} == {threading.current_thread()}
    assert sorted({rows for _, _, rows in log}) == [2, 4]  # waves of 4, 4, 2


def test_caller_waves_equal_scheduler_thread_waves(toy, make_requests):
    """The same requests, waves in the caller vs in the scheduler thread: bit-identical."""
    with EmbeddedEngine(toy, max_num_seqs=4) as engine:
        mine = engine.generate_many(make_requests(9, P))
    with EmbeddedEngine(toy, max_num_seqs=4) as engine:
        futs = engine.submit_many(make_requests(9, P))
        theirs = [f.result(timeout=60) for f in futs]
    for a, b in zip(mine, theirs):
        for name in ("latents", "log_probs", "final_latent", "media"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_on_ready_between_waves_in_the_calling_thread(toy, make_requests):
    log: list = []
    record_threads(toy, log)
    ready: list = []

    def on_ready(indices, trajs):
        assert threading.current_thread() is threading.main_thread()
        assert [t.request_id for t in trajs] == [f"r{i}" for i in indices]
        ready.append((list(indices), len(log)))  # forwards run so far

    with EmbeddedEngine(toy, max_num_seqs=4) as engine:
        engine.generate_many(make_requests(10, P), on_ready=on_ready)
    assert [i for i, _ in ready] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    per_wave = P.num_steps  # one forward per step (no guidance)
    assert [n for _, n in ready] == [per_wave, 2 * per_wave, 3 * per_wave]


def test_scheduler_thread_uses_the_engine_threads(toy, make_requests):
    log: list = []
    record_threads(toy, log)
    before = torch.get_num_threads()
    with EmbeddedEngine(toy, max_num_seqs=4, threads=1) as engine:
        futs = engine.submit_many(make_requests(4, P))
        [f.result(timeout=60) for f in futs]
    assert {n for _, n, _ in log} == {1}
    assert {t.name for t, _, _ in log} == {"diffusion-rollout-scheduler"}
    assert torch.get_num_threads() == before  # the caller's own count is untouched
    with pytest.raises(ValueError, match="threads"):
        EmbeddedEngine(toy, threads=0)


def test_one_driver_at_a_time(toy, make_requests):
    """Two blocking callers and the scheduler thread at once: all finish, no forwards
    overlap, and each caller gets its own requests back in order."""
    log: list = []
    record_threads(toy, log)
    out: dict = {}
    with EmbeddedEngine(toy, max_num_seqs=3) as engine:
        futs = engine.submit_many(make_requests(5, P, prefix="s"))

        def caller(name):
            out[name] = engine.generate_many(make_requests(7, P, prefix=name))

        threads = [threading.Thread(target=caller, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [f.result(timeout=60).request_id for f in futs] == [f"s{i}" for i in range(5)]
    assert toy.max_concurrent == 1
    for name in ("a", "b"):
        assert [t.request_id for t in out[name]] == [f"{name}{i}" for i in range(7)]


def test_abort_from_another_thread_while_the_caller_drives(toy, make_requests):
    log: list = []
    record_threads(toy, log)
    with EmbeddedEngine(toy, max_num_seqs=2) as engine:
        inner = toy.velocity

        def velocity(*args):  # aborts the last request during the first wave
            if len(log) == 1:
                t = threading.Thread(target=engine.abort, args=("r5",))
                t.start()
                t.join()
            return inner(*args)

        toy.velocity = velocity
        with pytest.raises(RequestAborted, match="r5"):
            engine.generate_many(make_requests(6, P))
        assert engine.stats()["aborted"] == 1
        # the engine keeps serving, still in the caller's thread
        (t,) = engine.generate_many(make_requests(1, P))
    assert t.request_id == "r0"
    assert {th for th, _, _ in log} == {threading.current_thread()}
