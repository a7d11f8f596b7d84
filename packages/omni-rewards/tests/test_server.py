from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest
from omni_rewards_testutils import ServerThread, free_port, solid

from omni_rewards import RewardInput, RewardInputError, load_reward
from omni_rewards.limits import RewardLimits
from omni_rewards.server import create_app
from omni_rewards.wire import decode_input, encode_input, encode_png

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def server():
    app = create_app(
        load_reward("color_match"),
        token=TOKEN,
        max_batch=32,
        max_wait_ms=20,
        limits=RewardLimits(max_request_mb=200_000 / 2**20),
    )
    srv = ServerThread(app)
    yield srv, app
    srv.stop()


def _auth():
    return {"authorization": f"Bearer {TOKEN}"}


def test_wire_roundtrip():
    imgs = np.stack([solid((i * 20, 0, 0)) for i in range(3)])
    inp = RewardInput(
        images=imgs,
        prompts=["red"] * 3,
        latents=np.ones((3, 4, 2, 2), np.float32),
        metadata=[{"i": i} for i in range(3)],
    )
    back = decode_input(json.loads(json.dumps(encode_input(inp))))
    np.testing.assert_array_equal(np.stack(back.image_list()), imgs)
    np.testing.assert_array_equal(back.latents, inp.latents)
    assert back.prompts == ["red"] * 3 and back.metadata[2] == {"i": 2}


def test_100_concurrent_requests_nothing_lost(server):
    srv, app = server
    before = dict(app.state.coalescer.stats)
    colours = [(i, 255 - i, (7 * i) % 256) for i in range(100)]

    async def one(client, i):
        body = {
            "images": [encode_png(solid(colours[i], (16, 16)))],
            "prompts": [f"sample {i} is red"],
        }
        r = await client.post(f"{srv.url}/score", json=body, headers=_auth())
        return i, r

    async def run_all():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(100)))

    results = asyncio.run(run_all())
    reward = load_reward("color_match")
    expected = reward(
        images=np.stack([solid(c, (16, 16)) for c in colours]), prompts=["red"] * 100
    ).scores
    for i, r in results:
        assert r.status_code == 200, r.text
        assert r.json()["scores"] == [pytest.approx(float(expected[i]), abs=1e-6)]
    stats = app.state.coalescer.stats
    assert stats["requests"] - before["requests"] == 100
    # coalescing: far fewer reward batches than requests
    assert stats["batches"] - before["batches"] < 100
    assert stats["max_batch_seen"] > 1


def test_malformed_requests_get_4xx_and_server_keeps_serving(server):
    srv, _ = server
    url = f"{srv.url}/score"
    good = {"images": [encode_png(solid((255, 0, 0)))], "prompts": ["red"]}
    cases = [
        ({}, dict(json=good), 401, "bearer token"),
        ({"authorization": "Bearer wrong"}, dict(json=good), 401, "bearer token"),
        (_auth(), dict(content=b"{not json"), 400, "not valid JSON"),
        (_auth(), dict(json=[1, 2]), 400, "expected a JSON object"),
        (
            _auth(),
            dict(json={"images": ["!!!"], "prompts": ["red"]}),
            400,
            "images[0]: invalid base64",
        ),
        (
            _auth(),
            dict(json={"images": [base64.b64encode(b"not an image").decode()], "prompts": ["red"]}),
            400,
            "images[0]: cannot decode image bytes",
        ),
        (
            _auth(),
            dict(json={"images": [encode_png(solid((0, 0, 0)))] * 2, "prompts": ["red"]}),
            400,
            "images=2, prompts=1",
        ),
        (_auth(), dict(json={"imgs": []}), 400, "unknown fields ['imgs']"),
        (_auth(), dict(json={"latents": "AAAA"}), 400, "latents: not a valid safetensors"),
        (
            _auth(),
            dict(json={"images": [encode_png(solid((0, 0, 0)))], "prompts": ["no colour here"]}),
            422,
            "prompts[0]: no palette colour",
        ),
        (_auth(), dict(json={"prompts": ["red"]}), 422, "images: color_match needs"),
        (_auth(), dict(json={"prompts": []}), 400, "no samples"),
        (_auth(), dict(content=b"x" * 300_000), 413, "exceeds the limit"),
    ]
    with httpx.Client(timeout=30) as client:
        for headers, kw, status, msg in cases:
            r = client.post(url, headers=headers, **kw)
            assert r.status_code == status, (msg, r.status_code, r.text)
            assert msg in r.json()["error"], (msg, r.json())
            ok = client.post(url, headers=_auth(), json=good)
            assert ok.status_code == 200 and ok.json()["scores"] == [1.0]
        assert client.get(f"{srv.url}/health").json() == {"status": "ok", "reward": "color_match"}


def test_one_bad_request_does_not_fail_coalesced_neighbours(server):
    srv, _ = server

    async def run():
        async with httpx.AsyncClient(timeout=30) as client:
            bodies = [
                {
                    "images": [encode_png(solid((255, 0, 0)))],
                    "prompts": ["red" if i != 3 else "plain"],
                }
                for i in range(8)
            ]
            return await asyncio.gather(
                *(client.post(f"{srv.url}/score", json=b, headers=_auth()) for b in bodies)
            )

    rs = asyncio.run(run())
    assert [r.status_code for r in rs] == [200, 200, 200, 422, 200, 200, 200, 200]


def test_http_reward_client(server):
    srv, _ = server
    imgs = np.stack([solid((255, 0, 0)), solid((0, 0, 255))])
    client = load_reward("http", url=srv.url, token=TOKEN, batch_size=1)
    out = client(images=imgs, prompts=["red", "red"])
    np.testing.assert_allclose(out.scores, [1.0, 1 - np.sqrt(2) / np.sqrt(3)], atol=1e-5)
    out2 = asyncio.run(client.ascore(images=imgs, prompts=["red", "red"]))
    np.testing.assert_allclose(out2.scores, out.scores)
    np.testing.assert_allclose(out2.details["target_rgb"], [[255, 0, 0]] * 2)
    with pytest.raises(RewardInputError, match=r"HTTP 422.*prompts\[0\]"):
        client(images=imgs[:1], prompts=["no colour"])
    bad = load_reward("http", url=srv.url, token="nope")
    with pytest.raises(RuntimeError, match="401"):
        bad(images=imgs[:1], prompts=["red"])


def test_http_reward_retries_then_fails_on_dead_server():
    client = load_reward(
        "http", url=f"http://127.0.0.1:{free_port()}", retries=1, backoff=0.01, timeout=2
    )
    with pytest.raises(RuntimeError, match="ConnectError"):
        client(images=np.stack([solid((0, 0, 0))]), prompts=["red"])


def test_serve_cli_subprocess(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omni_rewards.cli",
            "serve",
            "brightness",
            "--port",
            str(port),
            "--log-level",
            "error",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        import time

        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError(proc.stderr.read().decode()) from None
                time.sleep(0.2)
        assert r.json()["reward"] == "brightness"
        out = load_reward("http", url=f"http://127.0.0.1:{port}")(
            images=np.stack([solid((255, 255, 255))])
        )
        assert out.scores[0] == pytest.approx(1.0)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
