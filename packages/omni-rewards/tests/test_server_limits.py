"""The reward server under bad input, load and slow clients (loopback only, bounded loops).

Malformed input gets a 4xx JSON naming the field; decoding runs off the event loop; the pixel
budget holds per request and over the requests in flight; a full server answers 429 with
Retry-After; connection limits (read timeout, cap, auth before the body); one-line CLI errors.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from omni_rewards_testutils import ServerThread, solid
from PIL import Image
from safetensors.numpy import save as save_tensors

from omni_rewards import load_reward
from omni_rewards.base import Reward
from omni_rewards.limits import HTTPLimits, RewardLimits
from omni_rewards.safe_json import JSONBodyError, parse_json_body
from omni_rewards.server import create_app
from omni_rewards.types import RewardOutput
from omni_rewards.wire import count_pixels, encode_png


def png(size: tuple[int, int], colour=(255, 0, 0), mode: str = "RGB") -> str:
    """base64 PNG of one colour (compresses to a few kB whatever its size)."""
    buf = io.BytesIO()
    Image.new(mode, size, colour if mode == "RGB" else 0).save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode()


class Gated(Reward):
    """Scores 0.5 per sample once ``gate`` is set: a reward that is busy until told."""

    name = "gated"

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def score_batch(self, inp):
        assert self.gate.wait(30)
        return RewardOutput(np.full(inp.batch_size, 0.5), {})


@contextlib.contextmanager
def running(reward, token=None, **limits):
    http = {k: limits.pop(k) for k in list(limits) if k in HTTPLimits.__dataclass_fields__}
    app = create_app(
        reward, token=token, max_wait_ms=1, limits=RewardLimits(**limits, http=HTTPLimits(**http))
    )
    srv = ServerThread(app)
    try:
        yield srv, app
    finally:
        srv.stop()


def _raw(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(data)
    return s


def _read_all(s: socket.socket) -> bytes:
    chunks = []
    with contextlib.suppress(OSError):
        while chunk := s.recv(65536):
            chunks.append(chunk)
    s.close()
    return b"".join(chunks)


def test_malformed_requests_name_the_field():
    red = png((16, 16))
    audio = base64.b64encode(save_tensors({"data": np.zeros((1, 8), np.float32)})).decode()
    cases = [
        (b'{"images": ["' + red.encode() + b'"], "references": [NaN]}', 400, "references[0]"),
        (b'{"images": ["' + red.encode() + b'"], "references": [1e999]}', 400, "references[0]"),
        (json.dumps({"audio": audio, "sample_rate": "16000"}).encode(), 400, "sample_rate"),
        (json.dumps({"audio": audio, "sample_rate": 10**12}).encode(), 400, "sample_rate"),
        (b'{"audio": "' + audio.encode() + b'", "sample_rate": NaN}', 400, "sample_rate"),
        (b'{"prompts": ["x"], "sample_rate": ' + b"9" * 5000 + b"}", 400, "sample_rate"),
        (b'{"images": ["' + red.encode() + b'"], "sample_rate": -3}', 400, "sample_rate"),
        (b'{"metadata": ' + b"[" * 100 + b"]" * 100 + b"}", 400, "metadata"),
        (b'{"metadata": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400, "body"),
        (json.dumps({"images": [png((9000, 9000), mode="1")]}).encode(), 400, "images[0]"),
        (json.dumps({"images": [red, "!!"]}).encode(), 400, "images[1]"),
        (b'{"images": "\xff"}', 400, "body"),
        (b"{not json", 400, "body"),
        (json.dumps({"imgs": [red]}).encode(), 400, "imgs"),
        (json.dumps({"images": [red, red], "prompts": ["x"]}).encode(), 400, "images"),
    ]
    with running(load_reward("brightness")) as (srv, _), httpx.Client(timeout=30) as http:
        for content, status, field in cases:
            r = http.post(f"{srv.url}/score", content=content)
            assert r.status_code == status, (content[:60], r.status_code, r.text)
            assert r.json()["field"].startswith(field), (content[:60], r.json())
        for method, path, status in [("GET", "/nope", 404), ("GET", "/score", 405)]:
            r = http.request(method, f"{srv.url}{path}")
            assert r.status_code == status and r.json()["kind"], r.text
        ok = http.post(f"{srv.url}/score", json={"images": [red]})
        assert ok.status_code == 200 and ok.json()["scores"][0] > 0


def test_parse_json_body_and_count_pixels():
    assert parse_json_body(b'{"metadata": [{"a": 1.5}]}') == {"metadata": [{"a": 1.5}]}
    with pytest.raises(JSONBodyError) as info:
        parse_json_body(b'{"metadata": [{"a": Infinity}]}')
    assert info.value.field == "metadata[0].a"
    obj = {"images": [png((30, 20)), png((5, 4))], "videos": [[png((3, 3))] * 4]}
    assert count_pixels(obj) == 30 * 20 + 5 * 4 + 4 * 9


def test_pixel_budget_per_request_is_checked_before_decoding(monkeypatch):
    import omni_rewards.server as server

    decoded = []
    real = server.decode_input
    monkeypatch.setattr(server, "decode_input", lambda obj: decoded.append(1) or real(obj))
    big = png((2000, 2000))  # 4 M pixels in a few kB of PNG
    with running(load_reward("brightness"), max_request_pixels=10_000_000) as (srv, _):
        r = httpx.post(f"{srv.url}/score", json={"images": [big] * 3}, timeout=30)
        assert r.status_code == 413 and r.json()["field"] == "images", r.text
        assert decoded == []  # refused from the headers alone
        r = httpx.post(f"{srv.url}/score", json={"images": [big] * 2}, timeout=30)
        assert r.status_code == 200 and decoded == [1]


def test_decode_runs_off_the_event_loop(monkeypatch):
    """While a request's decode is held inside the decode pool, /health still answers: the
    decode cannot be on the event loop (if it were, the /health call would time out)."""
    import omni_rewards.server as server

    inside, release = threading.Event(), threading.Event()
    real = server.decode_input

    def held(obj):
        inside.set()
        assert release.wait(30)
        return real(obj)

    monkeypatch.setattr(server, "decode_input", held)
    with running(load_reward("brightness")) as (srv, _):
        result = {}
        t = threading.Thread(
            target=lambda: result.update(
                r=httpx.post(f"{srv.url}/score", json={"images": [png((64, 64))]}, timeout=30)
            )
        )
        t.start()
        assert inside.wait(10)
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        release.set()
        t.join(30)
        assert result["r"].status_code == 200


def test_full_server_answers_429_with_retry_after():
    gated = Gated()
    limits = {"max_queue": 2, "max_pending_pixels": 5000, "max_request_pixels": 5000}
    with running(gated, **limits) as (srv, _):

        async def burst():
            async with httpx.AsyncClient(timeout=30) as http:
                body = {"images": [png((40, 40))]}  # 1600 pixels: 3 fit the pixel budget
                tasks = [
                    asyncio.ensure_future(http.post(f"{srv.url}/score", json=body))
                    for _ in range(5)
                ]
                await asyncio.sleep(1.0)
                assert (await http.get(f"{srv.url}/health")).status_code == 200
                gated.gate.set()
                return await asyncio.gather(*tasks)

        answers = asyncio.run(burst())
        codes = sorted(r.status_code for r in answers)
        assert codes == [200, 200, 429, 429, 429], codes
        assert all(r.headers["retry-after"] == "1" for r in answers if r.status_code == 429)
        stats = httpx.get(f"{srv.url}/stats", timeout=5).json()["server"]
        assert (
            stats["in_flight"] == 0 and stats["pending_pixels"] == 0 and stats["pending_bytes"] == 0
        )


def test_pending_pixel_budget_answers_429():
    gated = Gated()
    with running(gated, max_pending_pixels=3000, max_request_pixels=2000) as (srv, _):

        async def two():
            async with httpx.AsyncClient(timeout=30) as http:
                first = asyncio.ensure_future(
                    http.post(f"{srv.url}/score", json={"images": [png((40, 40))]})
                )
                await asyncio.sleep(0.5)
                second = await http.post(f"{srv.url}/score", json={"images": [png((40, 40))]})
                gated.gate.set()
                return await first, second

        first, second = asyncio.run(two())
        assert first.status_code == 200 and second.status_code == 429, second.text


@pytest.mark.parametrize("call", ["sync", "async"])
def test_http_reward_waits_out_the_servers_429(call):
    """The real server, full (max_queue 1, one request held): the reward's request is answered
    429 with `Retry-After: 1` and `Connection: close`, waits, tries again on a new connection
    and is scored once the server frees up; `__call__` and `ascore` alike."""
    gated = Gated()
    with running(gated, max_queue=1) as (srv, _):

        def server_stats() -> dict:
            return httpx.get(f"{srv.url}/stats", timeout=5).json()["server"]

        def until(done) -> None:
            deadline = time.monotonic() + 60
            while not done(server_stats()):
                assert time.monotonic() < deadline, server_stats()
                time.sleep(0.05)

        body = {"images": [png((8, 8))]}
        holder = threading.Thread(
            target=lambda: httpx.post(f"{srv.url}/score", json=body, timeout=60)
        )
        holder.start()
        until(lambda st: st["in_flight"] == 1)
        reward = load_reward("http", url=srv.url, backoff=0.01, retries=5)
        image = np.stack([solid((0, 0, 0))])
        result = {}

        def score() -> None:
            if call == "sync":
                result["out"] = reward(images=image)
            else:
                result["out"] = asyncio.run(reward.ascore(images=image))

        caller = threading.Thread(target=score)
        caller.start()
        until(lambda st: st.get("overloaded", 0) >= 1)  # the reward's first try was refused
        gated.gate.set()
        caller.join(60)
        holder.join(60)
        assert result["out"].scores.tolist() == [0.5]
        assert server_stats()["answered"] == 2  # the held request and the retried one


def test_auth_before_body_read_timeout_and_connection_cap():
    with running(load_reward("brightness"), token="t0k", read_timeout_s=0.5, max_connections=8) as (
        srv,
        _,
    ):
        s = _raw(srv.port, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
        t0 = time.monotonic()
        answer = _read_all(s)
        assert b" 401 " in answer and b"bearer token" in answer
        assert time.monotonic() - t0 < 20  # not after the 100 MB (the read timeout is 0.5 s)
        slow = _raw(srv.port, b"POST /score HTTP/1.1\r\nHost: x\r\n")
        answer = _read_all(slow)
        assert b" 408 " in answer and b'"kind": "timeout"' in answer
        answer = _read_all(_raw(srv.port, b"\x00\x01garbage\r\n\r\n"))
        assert b" 400 " in answer and b"application/json" in answer
        idle = [_raw(srv.port, b"GET /hea") for _ in range(30)]  # far over the cap of 8
        for _ in range(5):
            assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        for s in idle:
            s.close()
        good = {"images": [encode_png(solid((255, 255, 255)))]}
        r = httpx.post(f"{srv.url}/score", json=good, headers={"authorization": "Bearer t0k"})
        assert r.status_code == 200


@pytest.mark.parametrize(
    "argv, words",
    [
        (["serve", "brightness", "--max-batch", "0"], "--max-batch"),
        (["serve", "brightness", "--max-request-pixels", "0"], "--max-request-pixels"),
        (["serve", "brightness", "--max-pending-mb", "1"], "--max-pending-mb"),
        (["serve", "brightness", "--read-timeout-s", "nan"], "--read-timeout-s"),
        (["serve", "brightness", "--port", "0"], "--port"),
        (["serve", "brightness", "--max-queue", "x"], "--max-queue"),
        (["serve"], "name"),
        (["serve", "brightness", "-o", "nokeyvalue"], "key=value"),
    ],
)
def test_cli_start_up_errors_are_one_line(argv, words, capsys):
    from omni_rewards import cli

    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    code = info.value.code
    text = code if isinstance(code, str) else capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in text and words in text, text


def test_cli_start_up_error_keeps_the_messages_quotes():
    """The message is printed whole: a value quoted at its end keeps its closing quote, and a
    KeyError's message is not wrapped in the quotes of its repr."""
    from omni_rewards import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "ocr", "-o", "backend=zz"])
    assert str(info.value.code).endswith("got 'zz'"), info.value.code
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "nope"])
    assert "KeyError: unknown reward 'nope';" in str(info.value.code), info.value.code


def test_cli_unknown_reward_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "omni_rewards.cli", "serve", "nope", "--port", "8111"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "unknown reward 'nope'" in lines[0], (
        proc.stderr
    )


def _json_values():
    from hypothesis import strategies as st

    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(10**25), max_value=10**25),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
        st.sampled_from([png((3, 2)), "!!", ""]),
    )
    return st.recursive(
        leaf,
        lambda kids: (
            st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
        ),
        max_leaves=12,
    )


def test_fuzzed_bodies_are_4xx_not_500():
    """Any JSON object over the known fields decodes or raises an error the server answers
    with a 4xx (WireError / RewardInputError / ValueError / TypeError), never anything else."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from omni_rewards.types import RewardInputError
    from omni_rewards.wire import WireError, decode_input

    fields = st.sampled_from(
        [
            "images",
            "videos",
            "latents",
            "audio",
            "sample_rate",
            "texts",
            "prompts",
            "references",
            "metadata",
        ]
    )

    @settings(max_examples=300, deadline=None)
    @given(st.dictionaries(fields, _json_values(), max_size=4))
    def check(obj):
        body = json.dumps(obj).encode()
        try:
            parsed = parse_json_body(body)
            count_pixels(parsed)
            decode_input(parsed)
        except (JSONBodyError, WireError, RewardInputError, ValueError, TypeError):
            pass

    check()
