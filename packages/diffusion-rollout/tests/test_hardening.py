"""The server under bad input, load and abandoned requests (loopback only, bounded loops).

Weight updates all or nothing; limits that name the field; cancellation of requests whose
client went away or whose deadline passed; connection limits (read timeout, cap, auth before
the body); one-line CLI start-up errors.
"""

from __future__ import annotations

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
import pytest
import torch

from diffusion_rollout import EmbeddedEngine, SamplingParams
from diffusion_rollout.safe_json import JSONBodyError, parse_json_body
from diffusion_rollout.weights import WeightsRejected, check_weights
from diffusion_rollout.wire import tensors_to_bytes, trajectory_from_bytes

P = SamplingParams(height=16, width=16, num_steps=4, sde_window_size=2, output="both")


def body(**fields):
    data = {"prompt": "a cat", "seed": 3, "params": P.to_dict(), **fields}
    return json.dumps(data).encode()


@contextlib.contextmanager
def serve(denoiser, *flags, token=None):
    """`diffusion-rollout serve` on a free loopback port (guarded protocol) in a thread."""
    import uvicorn

    from diffusion_rollout.cli import build_parser, build_server
    from diffusion_rollout.serving import uvicorn_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["serve", "--model", "toy", "--port", str(port), "--max-num-seqs", "8"]
    argv += [str(f) for f in flags] + (["--token", token] if token else [])
    app, engine = build_server(build_parser().parse_args(argv), lambda path, device: denoiser)
    config = uvicorn_config(
        app, host="127.0.0.1", port=port, limits=app.state.limits.http, log_level="critical"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", engine, port
    finally:
        server.should_exit = True
        thread.join(10)
        engine.close()


@pytest.fixture
def slow_cls(toy_cls):
    class Slow(toy_cls):
        """The toy with a pause in every forward, so a wave takes a while."""

        delay_s = 0.03

        def velocity(self, latents, sigma, condition, params):
            time.sleep(self.delay_s)
            return super().velocity(latents, sigma, condition, params)

    return Slow


def health_ok(url: str) -> bool:
    """/health answers (how fast is the soak benchmark's to measure, not a test's)."""
    return httpx.get(f"{url}/health", timeout=10).status_code == 200


# ------------------------------------------------------------------ weight updates
def test_check_weights_names_the_bad_tensor():
    good = {"a": torch.zeros(2), "b": torch.ones(3)}
    assert check_weights(good, {"a": (2,)}) == good
    cases = [
        ({"a": torch.zeros(2), "b": torch.tensor([1.0, float("nan"), 0.0])}, "b", "NaN"),
        ({"a": torch.full((2,), float("inf"))}, "a", "NaN or infinite"),
        ({"a": torch.zeros(2, dtype=torch.int64)}, "a", "floating point"),
        ({"a": torch.zeros(3)}, "a", r"shape \(3,\), expected \(2,\)"),
        ({"a": [1.0, 2.0]}, "a", "torch.Tensor"),
    ]
    for tensors, field, msg in cases:
        with pytest.raises(WeightsRejected, match=msg) as info:
            check_weights(tensors, {"a": (2,)})
        assert info.value.field == field
    with pytest.raises(WeightsRejected, match="no tensors"):
        check_weights({})


def test_engine_update_is_all_or_nothing(toy, make_requests, max_diff):
    """A rejected update (wrong shape, NaN) leaves weights, version and trajectories as they
    were, although the toy's own load_weights would copy tensor by tensor."""
    reqs = make_requests(2, P)
    with EmbeddedEngine(toy) as engine:
        engine.update_weights({"proj_out.bias": torch.full((4,), 0.1)}, version=1)
        before = engine.generate_many(reqs)
        state = {k: v.clone() for k, v in toy.state_dict().items()}
        bad_updates = [
            {"cond_proj.bias": torch.ones(16), "proj_out.bias": torch.zeros(5)},
            {"cond_proj.bias": torch.ones(16), "proj_out.bias": torch.full((4,), float("nan"))},
        ]
        for update in bad_updates:
            with pytest.raises(WeightsRejected, match=r"proj_out\.bias"):
                engine.update_weights(update, version=2)
            assert engine.version == 1
            assert all(torch.equal(state[k], v) for k, v in toy.state_dict().items())
        after = engine.generate_many(reqs)
    assert max(max_diff(a, b) for a, b in zip(before, after)) == 0.0


def test_http_update_rejected_whole(toy_cls):
    toy = toy_cls()
    with serve(toy) as (url, _, _):
        http = httpx.Client(base_url=url, timeout=30)
        ok = http.post(
            "/update_weights?version=1",
            content=tensors_to_bytes({"proj_out.bias": torch.full((4,), 0.2)}),
        )
        assert ok.status_code == 200, ok.text
        ref = http.post("/generate", content=body())
        state = {k: v.clone() for k, v in toy.state_dict().items()}
        for update, field in [
            ({"cond_proj.bias": torch.ones(16), "proj_out.bias": torch.zeros(5)}, "proj_out.bias"),
            ({"proj_out.bias": torch.tensor([0.0, float("nan"), 0, 0])}, "proj_out.bias"),
            ({"proj_out.bias": torch.zeros(4, dtype=torch.int32)}, "proj_out.bias"),
        ]:
            r = http.post("/update_weights?version=2", content=tensors_to_bytes(update))
            assert r.status_code == 400 and r.json()["field"] == field, r.text
        for version in ("-1", "1e3", "9" * 40, "x"):
            r = http.post(
                f"/update_weights?version={version}",
                content=tensors_to_bytes({"proj_out.bias": torch.zeros(4)}),
            )
            assert r.status_code == 400 and r.json()["field"] == "version", r.text
        assert http.get("/health").json()["version"] == 1
        assert all(torch.equal(state[k], v) for k, v in toy.state_dict().items())
        again = http.post("/generate", content=body())
        a, b = trajectory_from_bytes(ref.content), trajectory_from_bytes(again.content)
        assert torch.equal(a.final_latent, b.final_latent) and b.version == 1


def test_weights_body_limit_is_its_own(toy):
    with serve(toy, "--max-weights-mb", 0.001, "--max-body-mb", 1) as (url, _, _):
        big = tensors_to_bytes({"proj_out.bias": torch.zeros(4), "pad": torch.zeros(1000)})
        r = httpx.post(f"{url}/update_weights?version=1", content=big)
        assert r.status_code == 413 and r.json()["field"] == "body"
        assert httpx.post(f"{url}/generate", content=body()).status_code == 200


# ------------------------------------------------------------------ request limits
class _Strict:
    """Mixin: SD3-like latent_shape rule (height and width multiples of 16), images only."""

    modality = "image"

    def latent_shape(self, params):
        for name in ("height", "width"):
            v = getattr(params, name)
            if v % 16:
                raise ValueError(f"{name}: {v} is not a positive multiple of 16")
        return super().latent_shape(params)


def _png_bomb() -> str:
    """A small PNG that declares 20000 x 20000 pixels."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_malformed_and_oversized_requests_name_the_field(toy_cls):
    strict = type("StrictToy", (_Strict, toy_cls), {})()
    params = P.to_dict()
    deep = b'{"prompt": "x", "seed": 1, "params": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    cases = [
        (body(params={**params, "num_steps": 20000}), "params.num_steps"),
        (body(params={**params, "height": 4096, "width": 4096}), "params.height"),
        (body(params={**params, "height": 33}), "params.height"),
        (body(params={**params, "num_frames": 3}), "params.num_frames"),
        (body(params={**params, "guidance_scale": 1e308}), "params.guidance_scale"),
        (body(params={**params, "noise_level": 1e6}), "params.noise_level"),
        (body(params=0), "params"),
        (body(request_id=0), "request_id"),
        (body(request_id="x" * 1000), "request_id"),
        (b'{"prompt": "x", "seed": 1, "params": {"guidance_scale": NaN}}', "params.guidance_scale"),
        (b'{"prompt": "x", "seed": 1, "params": {"noise_level": 1e999}}', "params.noise_level"),
        (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "seed"),
        (b'{"prompt": "x", "seed": 1, "params": {"height": 1' + b"0" * 30 + b"}}", "params.height"),
        (deep, "body"),  # past the parser's recursion limit: no path to name
        (b'{"prompt": "\xff\xfe", "seed": 1}', "body"),
        (body(image=_png_bomb()), "image"),
        (body(image="not base64!"), "image"),
        (b"[1, 2]", None),
    ]
    with serve(strict) as (url, _, _), httpx.Client(base_url=url, timeout=30) as http:
        for content, field in cases:
            r = http.post("/generate", content=content)
            assert r.status_code == 400, (content[:80], r.status_code, r.text)
            got = r.json()["field"]
            assert got == field or (field and got.startswith(field)), (content[:80], r.json())
        for method, path, status in [("GET", "/nope", 404), ("GET", "/generate", 405)]:
            r = http.request(method, path)
            assert r.status_code == status and r.json()["kind"], r.text
        assert http.post("/generate", content=body()).status_code == 200


def test_parse_json_body_paths():
    assert parse_json_body(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    for raw, field in [
        (b'{"a": [1, Infinity]}', "a[1]"),
        (b'{"a": {"b": -NaN}}', "body"),  # not JSON at all
        (b'{"a": {"b": NaN}}', "a.b"),
        (b"[" * 40 + b"]" * 40, "body" + "[0]" * 32),
    ]:
        with pytest.raises(JSONBodyError) as info:
            parse_json_body(raw)
        assert info.value.field == field, (raw, info.value.field)


def test_long_prompt_is_cut_before_encoding(toy_cls):
    seen = []

    class Recording(toy_cls):
        def encode(self, prompts, negative_prompts=None, *, params=None):
            seen.append(max(len(p) for p in prompts))
            return super().encode(prompts, negative_prompts, params=params)

    with serve(Recording(), "--max-prompt-tokens", 4) as (url, _, _):
        r = httpx.post(f"{url}/generate", content=body(prompt="word " * 200_000), timeout=30)
        assert r.status_code == 200, r.text
        assert trajectory_from_bytes(r.content).prompt == ("word " * 200_000)[: 4 * 32]
    assert seen == [4 * 32]


def test_max_wave_pixels_shrinks_waves(toy, make_requests):
    with EmbeddedEngine(toy, max_num_seqs=8, max_wave_pixels=3 * 32 * 32) as engine:
        futs = engine.submit_many(make_requests(7))
        for f in futs:
            f.result(30)
    assert max(toy.forward_rows) == 3


def test_queue_bound_answers_429(slow_cls):
    slow = slow_cls()
    slow.delay_s = 0.5
    with serve(slow, "--max-queue", 2, "--max-num-seqs", 1) as (url, _, _):

        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                import asyncio

                return await asyncio.gather(
                    *(http.post("/generate", content=body()) for _ in range(6))
                )

        import asyncio

        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert codes.count(200) >= 2 and 429 in codes and set(codes) <= {200, 429}, codes
        assert health_ok(url)


# ------------------------------------------------------------------ cancellation
def test_cancel_mid_wave_frees_rows_and_keeps_the_rest(slow_cls, make_requests, max_diff):
    slow = slow_cls()
    params = SamplingParams(height=16, width=16, num_steps=12, output="latent")
    a, b = make_requests(2, params)
    with EmbeddedEngine(slow_cls(), max_num_seqs=1) as solo:
        (ref_b,) = solo.generate_many([b])
    with EmbeddedEngine(slow, max_num_seqs=2, max_wait_ms=200) as engine:
        fa, fb = engine.submit_many([a, b])
        while len(slow.forward_rows) < 3:
            time.sleep(0.005)
        assert engine.cancel(fa)
        traj_b = fb.result(30)
        with pytest.raises(Exception, match="aborted"):
            fa.result(30)
        assert engine.stats()["aborted"] == 1
    assert slow.forward_rows[0] == 2 and slow.forward_rows[-1] == 1
    assert len(slow.forward_rows) == 12  # one wave, no extra steps
    assert max_diff(traj_b, ref_b) <= 1e-5


def test_abandoned_request_stops_and_next_client_is_served(slow_cls):
    slow = slow_cls()
    long_params = {**P.to_dict(), "num_steps": 200}
    with serve(slow) as (url, engine, _):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/generate", content=body(params=long_params), timeout=0.3)
        t0 = time.monotonic()
        while engine.stats()["aborted"] < 1:
            assert time.monotonic() - t0 < 10, engine.stats()
            time.sleep(0.02)
        steps_run = len(slow.forward_rows)
        assert steps_run < 200, steps_run  # stopped before its 200 steps
        r = httpx.post(f"{url}/generate", content=body(), timeout=30)
        assert r.status_code == 200


def test_deadline_stops_the_request(slow_cls):
    slow = slow_cls()
    with serve(slow, "--request-timeout-s", 0.3) as (url, engine, _):
        r = httpx.post(
            f"{url}/generate", content=body(params={**P.to_dict(), "num_steps": 200}), timeout=60
        )
        assert r.status_code == 504 and r.json()["kind"] == "deadline", r.text
        t0 = time.monotonic()
        while engine.stats()["pending"] or engine.stats()["aborted"] < 1:
            assert time.monotonic() - t0 < 10
            time.sleep(0.02)
        assert len(slow.forward_rows) < 200  # stopped before its 200 steps


# ------------------------------------------------------------------ connections
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


def test_read_timeout_and_connection_cap(toy):
    flags = ("--read-timeout-s", 0.5, "--max-connections", 8)
    with serve(toy, *flags) as (url, _, port):
        slow = _raw(port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le")
        t0 = time.monotonic()
        answer = _read_all(slow)
        assert b" 408 " in answer and b'"kind": "timeout"' in answer
        assert time.monotonic() - t0 > 0.3  # not before the read timeout
        idle = [_raw(port, b"GET /hea") for _ in range(30)]  # far over the cap of 8
        for _ in range(5):
            assert health_ok(url)
        for s in idle:
            s.close()


def test_auth_before_body_and_garbage_gets_json(toy):
    with serve(toy, token="s3cret") as (url, _, port):
        s = _raw(
            port,
            b"POST /update_weights?version=1 HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 100000000\r\n\r\n",
        )
        t0 = time.monotonic()
        answer = _read_all(s)
        assert b" 401 " in answer and b"bearer token" in answer
        assert time.monotonic() - t0 < 20  # not after the 100 MB (nor the 30 s read timeout)
        answer = _read_all(_raw(port, b"\x16\x03\x01 garbage \r\n\r\n"))
        assert b" 400 " in answer and b'"kind": "bad_request"' in answer
        assert health_ok(url)


# ------------------------------------------------------------------ CLI
@pytest.mark.parametrize(
    "argv, words",
    [
        (["nope"], "invalid choice"),
        (["serve", "--model", "m", "--port", "8111", "nope"], "unrecognized arguments: nope"),
        (["serve", "--model", "m", "--port", "8111", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["serve", "--model", "m", "--port", "8111", "--max-steps", "0"], "--max-steps"),
        (["serve", "--model", "m", "--port", "8111", "--max-steps", "x"], "--max-steps"),
        (["serve", "--model", "m", "--port", "8111", "--read-timeout-s", "inf"], "read-timeout"),
    ],
)
def test_cli_start_up_errors_are_one_line(argv, words, capsys, toy):
    from diffusion_rollout import cli

    with pytest.raises(SystemExit) as info:
        cli.main(argv, denoiser_factory=lambda path, device: toy)
    code = info.value.code
    text = code if isinstance(code, str) else capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in text and words in text, text


def test_cli_missing_model_is_one_line():
    """The real default loader (omni_adapters.from_pretrained, or the line saying it is not
    installed), in a subprocess: one line on stderr, no traceback."""
    argv = ["serve", "--model", "/missing/m", "--port", "8111"]
    proc = subprocess.run(
        [sys.executable, "-m", "diffusion_rollout.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "--model" in lines[0], proc.stderr


def test_fuzzed_bodies_are_400_not_500():
    """Any JSON body over the known fields parses, or raises one of the errors the server
    answers with a 400 naming a field; never anything else."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from diffusion_rollout.limits import LimitError, RolloutLimits, check_request
    from diffusion_rollout.params import RolloutRequest, SamplingParams

    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(10**22), max_value=10**22),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=10),
    )
    value = st.recursive(leaf, lambda k: st.lists(k, max_size=3), max_leaves=6)
    param_names = [f.name for f in __import__("dataclasses").fields(SamplingParams)]
    params = st.dictionaries(st.sampled_from(param_names), value, max_size=5)
    body = st.fixed_dictionaries(
        {"prompt": st.one_of(st.text(max_size=20), value), "seed": value},
        optional={
            "params": st.one_of(params, value),
            "request_id": value,
            "negative_prompt": value,
        },
    )

    @settings(max_examples=400, deadline=None)
    @given(body)
    def check(data):
        try:
            req = RolloutRequest.from_dict(parse_json_body(json.dumps(data).encode()))
            check_request(req, RolloutLimits())
        except (JSONBodyError, LimitError, ValueError, TypeError) as exc:
            assert str(exc)

    check()
