"""The HTTP server: round trip, malformed input, tokens, versions, concurrent clients."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from diffusion_rollout import (
    EmbeddedEngine,
    RolloutRequest,
    SamplingParams,
    VersionMismatchError,
)
from diffusion_rollout.client import RolloutClient
from diffusion_rollout.wire import (
    tensors_to_bytes,
    trajectory_from_bytes,
    trajectory_to_bytes,
    weights_checksum,
)

P = SamplingParams(height=16, width=16, num_steps=4, sde_window_size=2, output="both")


def reqs(n, prefix="h", params=P):
    return [RolloutRequest(f"prompt {i}", 50 + i, params, f"{prefix}{i}") for i in range(n)]


def test_wire_round_trip(toy):
    with EmbeddedEngine(toy) as engine:
        (t,) = engine.generate_many(reqs(1, params=P.replace(guidance_scale=2.0)))
    back = trajectory_from_bytes(trajectory_to_bytes(t))
    for name in ("latents", "log_probs", "sigmas", "sigmas_next", "final_latent", "media"):
        assert torch.equal(getattr(t, name), getattr(back, name)), name
    assert back.condition.keys() == t.condition.keys()
    assert (back.request_id, back.seed, back.window, back.version, back.params) == (
        t.request_id,
        t.seed,
        t.window,
        t.version,
        t.params,
    )
    assert back.timings == pytest.approx(t.timings)
    with pytest.raises(ValueError, match="safetensors"):
        trajectory_from_bytes(b"not a blob at all")


def test_checksum_matches_interface_definition():
    a = {"w": torch.arange(4, dtype=torch.float32), "b": torch.zeros(2, dtype=torch.bfloat16)}
    assert weights_checksum(a) == weights_checksum(dict(reversed(list(a.items()))))
    assert weights_checksum(a) != weights_checksum({**a, "w": torch.arange(4.0) + 1})


def test_client_over_http_matches_embedded(live_server, toy_cls, max_diff):
    url, _, _ = live_server
    rs = reqs(10)
    with EmbeddedEngine(toy_cls()) as local:
        ref = local.generate_many(rs)
    client = RolloutClient(url, concurrency=16)
    client.wait_ready()
    got = client.generate(rs)
    assert [t.request_id for t in got] == [r.request_id for r in rs]
    assert max(max_diff(a, b) for a, b in zip(ref, got)) <= 1e-5
    assert all(torch.equal(a.media, b.media) for a, b in zip(ref, got))
    st = client.stats()
    assert st["requests"] == 10 and st["mean_rows_per_forward"] > 1  # HTTP requests were batched


def test_malformed_requests_get_4xx_and_server_survives(live_server):
    url, _, _ = live_server
    cases = [
        (b"{not json", "body"),
        (b'{"prompt": "x"}', "seed"),
        (b'{"prompt": "x", "seed": "7"}', "seed"),
        (b'{"prompt": 3, "seed": 7}', "prompt"),
        (b'{"prompt": "x", "seed": 1, "params": {"height": -4}}', "params.height"),
        (b'{"prompt": "x", "seed": 1, "params": {"output": "gif"}}', "params.output"),
        (b'{"prompt": "x", "seed": 1, "params": {"colour": 1}}', "colour"),
        (b'{"prompt": "x", "seed": 1, "bogus": 1}', "bogus"),
        (b"[1, 2]", None),
    ]
    with httpx.Client(base_url=url) as http:
        for body, field in cases:
            r = http.post("/generate", content=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["field"] == field, (body, r.json())
        r = http.post("/update_weights?version=1", content=b"garbage")
        assert r.status_code == 400 and r.json()["field"] == "body"
        r = http.post("/update_weights", content=tensors_to_bytes({"x": torch.zeros(1)}))
        assert r.status_code == 400 and r.json()["field"] == "version"
        r = http.post(
            "/update_weights?version=1", content=tensors_to_bytes({"nope": torch.zeros(1)})
        )
        assert r.status_code == 400 and "nope" in r.json()["error"]
        assert http.get("/health").json()["status"] == "ok"
    assert len(RolloutClient(url).generate(reqs(2))) == 2


def test_weights_and_versions_over_http(live_server):
    url, _, _ = live_server
    client = RolloutClient(url)
    before = client.generate(reqs(1))[0]
    new = {"proj_out.bias": torch.full((4,), 0.3)}
    answer = client.update_weights(new, 1)
    assert answer["version"] == 1 and answer["checksum"] == weights_checksum(new)
    after = client.generate(reqs(1), version=1)[0]
    assert after.version == 1 and not torch.equal(before.final_latent, after.final_latent)
    with pytest.raises(VersionMismatchError):
        client.generate(reqs(1), version=0)
    with pytest.raises(VersionMismatchError, match="not newer"):
        client.update_weights(new, 1)


def test_concurrent_clients_lose_nothing(live_server):
    url, engine, _ = live_server
    out: dict[str, list] = {}

    def run(name):
        out[name] = RolloutClient(url, concurrency=8).generate(reqs(12, prefix=name))

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for name in ("a", "b", "c"):
        assert [t.request_id for t in out[name]] == [f"{name}{i}" for i in range(12)]
    assert engine.stats()["requests"] == 36


@pytest.mark.parametrize("live_server", [{"token": "s3cret"}], indirect=True)
def test_bearer_token(live_server):
    url, _, _ = live_server
    with httpx.Client(base_url=url) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/generate", json=reqs(1)[0].to_dict())
        assert r.status_code == 401 and r.json()["field"] == "Authorization"
        r = http.get("/stats", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    with pytest.raises(ValueError, match="401"):
        RolloutClient(url).generate(reqs(1))
    assert len(RolloutClient(url, token="s3cret").generate(reqs(1))) == 1


def test_cli_main_wires_uvicorn(monkeypatch, toy):
    from diffusion_rollout import cli, serving

    seen = {}
    monkeypatch.setattr(serving, "run", lambda app, **kw: seen.update(app=app, **kw))
    rc = cli.main(
        ["serve", "--model", "m", "--port", "8123", "--max-num-seqs", "4", "--max-steps", "9"],
        denoiser_factory=lambda path, device: toy,
    )
    assert rc == 0 and seen["host"] == "127.0.0.1" and seen["port"] == 8123
    assert seen["app"].state.limits.max_steps == 9
    assert seen["limits"] == seen["app"].state.limits.http


def test_cli_without_omni_adapters_explains(monkeypatch):
    import importlib

    from diffusion_rollout import cli

    def fake_import(name, *a):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(SystemExit, match="omni-adapters"):
        cli._load_with_omni_adapters("some/path", None)
    with pytest.raises(SystemExit, match="port"):
        cli.build_server(cli.build_parser().parse_args(["serve", "--model", "m", "--port", "0"]))


def test_one_thread_team_while_serving(live_server):
    """Waves run only in the scheduler thread; the worker threads that load weights run torch
    on one thread, so they never start an OpenMP team of their own beside it."""
    url, _, toy = live_server
    seen: dict[str, list] = {"velocity": [], "load": []}
    velocity, load = toy.velocity, toy.load_weights

    def seen_velocity(*args):
        seen["velocity"].append(threading.current_thread().name)
        return velocity(*args)

    def seen_load(tensors):
        seen["load"].append((threading.current_thread(), torch.get_num_threads()))
        return load(tensors)

    toy.velocity, toy.load_weights = seen_velocity, seen_load
    client = RolloutClient(url)
    client.generate(reqs(3))
    client.update_weights({"proj_out.bias": torch.full((4,), 0.1)}, 1)
    assert set(seen["velocity"]) == {"diffusion-rollout-scheduler"}
    ((thread, threads),) = seen["load"]
    assert threads == 1 and thread is not threading.main_thread()


def test_serve_loads_the_model_off_the_main_thread(toy):
    """The model loads in a short-lived thread: the main thread (the event loop) then holds
    no OpenMP team beside the scheduler's; a failed load still reports in one line."""
    from diffusion_rollout.cli import build_parser, build_server

    loaded_in: list[threading.Thread] = []

    def factory(path, device):
        loaded_in.append(threading.current_thread())
        return toy

    args = build_parser().parse_args(["serve", "--model", "toy", "--port", "8000"])
    _, engine = build_server(args, factory)
    engine.close()
    assert loaded_in and loaded_in[0] is not threading.main_thread()
    assert not loaded_in[0].is_alive()

    def broken(path, device):
        raise OSError("no such folder")

    with pytest.raises(SystemExit, match=r"cannot load --model toy: .*no such folder"):
        build_server(args, broken)
