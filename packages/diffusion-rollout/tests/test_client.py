"""RolloutClient over in-process engines: order, retries, versions, progress, concurrency."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from diffusion_rollout import (
    EmbeddedEngine,
    RequestAborted,
    RolloutRequest,
    SamplingParams,
    VersionMismatchError,
)
from diffusion_rollout.client import RolloutClient

P = SamplingParams(height=16, width=16, num_steps=4, sde_window_size=2, output="latent")


class FakeEngine:
    """Answers instantly with a trajectory stub; aborts some requests a few times."""

    def __init__(self, abort_times=None, version=0, delay=0.0):
        self.abort_times = dict(abort_times or {})
        self.version = version
        self.delay = delay
        self.calls = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def generate(self, req):
        self.calls.append(req.request_id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if self.abort_times.get(req.request_id, 0) > 0:
                self.abort_times[req.request_id] -= 1
                raise RequestAborted(f"aborted {req.request_id}")
            return dataclasses.make_dataclass("T", ["request_id", "version"])(
                req.request_id, self.version
            )
        finally:
            self.in_flight -= 1


def reqs(n, params=P):
    return [RolloutRequest(f"p{i}", i, params, f"id{i}") for i in range(n)]


def test_order_and_equality_with_engine(toy, max_diff):
    rs = reqs(12)
    with EmbeddedEngine(toy, max_num_seqs=8) as engine:
        direct = engine.generate_many(rs)
        via = RolloutClient(engine, concurrency=64).generate(rs)
        st = engine.stats()
    assert [t.request_id for t in via] == [r.request_id for r in rs]
    assert max(max_diff(a, b) for a, b in zip(direct, via)) <= 1e-5
    # one submit_many per loop turn: the client's 12 requests fill waves of 8 + 4
    assert st["waves"] == 4


def test_retries_aborted_requests():
    eng = FakeEngine(abort_times={"id1": 2, "id3": 1})
    client = RolloutClient(eng, concurrency=4, retry_backoff_s=0.001)
    out = client.generate(reqs(5))
    assert [t.request_id for t in out] == [f"id{i}" for i in range(5)]
    assert client.retries == 3 and eng.calls.count("id1") == 3


def test_gives_up_after_max_retries():
    eng = FakeEngine(abort_times={"id0": 5})
    client = RolloutClient(eng, max_retries=2, retry_backoff_s=0.001)
    with pytest.raises(RequestAborted, match="id0"):
        client.generate(reqs(2))
    assert eng.calls.count("id0") == 3


def test_version_mismatch_raises():
    client = RolloutClient(FakeEngine(version=1))
    with pytest.raises(VersionMismatchError, match="asked for weights version 2"):
        client.generate(reqs(3), version=2)
    assert len(client.generate(reqs(3), version=1)) == 3
    with pytest.raises(ValueError, match=r"requests\[0\].params.weights_version=5"):
        client.generate(reqs(1, P.replace(weights_version=5)), version=1)


def test_pinned_version_reaches_engine(toy):
    with EmbeddedEngine(toy, version=4) as engine:
        out = RolloutClient(engine).generate(reqs(2), version=4)
        assert [t.version for t in out] == [4, 4]
        with pytest.raises(VersionMismatchError, match="engine is at version 4"):
            RolloutClient(engine).generate(reqs(1), version=3)


def test_concurrency_limit():
    eng = FakeEngine(delay=0.01)
    RolloutClient(eng, concurrency=3).generate(reqs(10))
    assert eng.max_in_flight == 3


def test_progress_bar(capsys):
    RolloutClient(FakeEngine()).generate(reqs(4), progress=True)
    assert "rollout" in capsys.readouterr().err
    RolloutClient(FakeEngine(), progress_min=100).generate(reqs(4))
    assert "rollout" not in capsys.readouterr().err


def test_sync_generate_inside_running_loop(toy):
    with EmbeddedEngine(toy) as engine:
        client = RolloutClient(engine)

        async def main():
            return client.generate(reqs(2))  # blocking call from async code still works

        assert len(asyncio.run(main())) == 2


def test_update_weights_through_client(toy):
    with EmbeddedEngine(toy) as engine:
        client = RolloutClient(engine)
        client.update_weights({"proj_out.bias": torch.ones(4)}, 1)
        assert engine.version == 1 and client.stats()["version"] == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="concurrency"):
        RolloutClient(FakeEngine(), concurrency=0)
    with pytest.raises(TypeError, match="engine_or_url"):
        RolloutClient(42)
