"""Soak: both servers under many concurrent clients plus a burst of malformed traffic.

    python benchmarks/soak.py [--clients 500] [--requests 2] [--malformed 300] [--model DIR]
    uv run nox -s soak [-- --clients 500 ...]

Each server is its own process, started by its real command line on 127.0.0.1 with a bearer
token: ``diffusion-rollout serve --model <omni_adapters tiny SD3>`` and ``omni-rewards serve
brightness``, one after the other. For each:

1. ``--clients`` clients at once (one connection each) send ``--requests`` good requests each
   (rollout: 32x32, 4 steps, CFG 4.5; reward: one 32x32 PNG and a prompt);
2. one second in, a burst of ``--malformed`` bad requests goes in at once: the kinds below,
   cycled (garbage bytes, bad JSON, NaN / 1e308 / 5000-digit numbers, 100000-deep nesting,
   decompression-bomb PNGs, over-limit sizes and steps, bodies declared at 10 GB, wrong or
   missing tokens, half-sent requests that never finish, clients that hang up mid-request,
   half-bad and NaN weight updates, unknown paths and methods);
3. a separate prober process asks ``/health`` every 0.1 s on a fresh connection all along.

Printed per server: good requests answered (200) of those sent; every malformed kind with the
answers it got (status and the JSON ``kind``); the count of 5xx answers to client mistakes and
of malformed requests without a 4xx; the server's peak memory (``VmHWM``) next to its memory
after start-up; p50 / p99 / max latency of the good requests and of ``/health`` (with the
probes that failed). For the rollout server also whether a reference trajectory is
bit-identical after the burst of rejected weight updates and the version is unchanged.
Nothing is asserted: these are measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

TOKEN = "soak-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
#: malformed kinds whose right answer is not a 4xx
NOT_4XX = {
    "client_hangs_up": "(no one listens: the server stops the request)",
    "prompt_2mb": "(200: cut to --max-prompt-tokens before encoding)",
}
READ_TIMEOUT_S = 30  # the servers' default --read-timeout-s: half-sent requests are cut then
ROLLOUT_PARAMS = {
    "height": 32,
    "width": 32,
    "num_steps": 4,
    "guidance_scale": 4.5,
    "sde_window_size": 2,
}


# ---------------------------------------------------------------------------- helpers
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (peak resident set) of a process, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def png_b64(size: tuple[int, int], mode: str = "RGB", colour: int | tuple = (200, 30, 30)) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode()


def start(argv: list[str], port: int, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start within 600 s")


# ---------------------------------------------------------------------------- raw HTTP
async def raw_exchange(port: int, data: bytes, *, hold_s: float = 0.0, wait_s: float = 30.0):
    """Send ``data`` (optionally pausing ``hold_s`` before closing our side) and read the
    answer until the server closes; returns (status or None, JSON kind or None)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(1 << 20), timeout=wait_s)
        while raw and b"\r\n\r\n" in raw and len(raw) < 1 << 20:
            head, _, body = raw.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                None,
            )
            if length is None or len(body) >= length:
                break
            more = await asyncio.wait_for(reader.read(1 << 20), timeout=wait_s)
            if not more:
                break
            raw += more
    except (asyncio.TimeoutError, ConnectionError) as exc:
        return None, type(exc).__name__
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    if not raw.startswith(b"HTTP/1.1 "):
        return None, "no_http_answer"
    status = int(raw[9:12])
    body = raw.partition(b"\r\n\r\n")[2]
    if status < 300:
        return status, "ok"
    try:
        kind = json.loads(body).get("kind")
    except ValueError:
        kind = "not_json"
    return status, kind


def http_request(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    headers = {"host": "127.0.0.1", "content-length": str(len(body)), **(headers or {})}
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def post(path: str, body: bytes, auth: bool = True, **headers) -> bytes:
    return http_request("POST", path, body, {**(AUTH if auth else {}), **headers})


# ---------------------------------------------------------------------------- malformed kinds
def rollout_malformed(model: str) -> dict[str, object]:
    """kind -> bytes to send (or a callable(port) coroutine for the stateful ones)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save

    # the transformer's first and last parameter (sorted), as the trainer names them: a good
    # changed tensor next to a wrong-shape or NaN one
    (weights,) = Path(model, "transformer").glob("*.safetensors")
    with safe_open(str(weights), "pt") as f:
        names = sorted(f.keys())
        first_shape = f.get_slice(names[0]).get_shape()
    first, last = names[0], names[-1]

    def gen(**fields) -> bytes:
        data = {"prompt": "a cat", "seed": 1, "params": ROLLOUT_PARAMS, **fields}
        return post("/generate", json.dumps(data).encode())

    p = ROLLOUT_PARAMS
    bomb = png_b64((20000, 20000), mode="1", colour=0)
    half_bad = save({first: torch.ones(first_shape), last: torch.zeros(3, 3)})
    nan_update = save({first: torch.full(first_shape, float("nan"))})

    async def abandoned(port: int):
        body = json.dumps({"prompt": "long", "seed": 2, "params": {**p, "num_steps": 150}})
        try:
            return await raw_exchange(port, post("/generate", body.encode()), wait_s=0.5)
        except Exception as exc:  # recorded as the outcome
            return None, type(exc).__name__

    return {
        "garbage_bytes": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64),
        "bad_json": post("/generate", b"{not json"),
        "bad_utf8": post("/generate", b'{"prompt": "\xff\xfe", "seed": 1}'),
        "nan_guidance": post(
            "/generate", b'{"prompt": "x", "seed": 1, "params": {"guidance_scale": NaN}}'
        ),
        "guidance_1e308": gen(params={**p, "guidance_scale": 1e308}),
        "seed_5000_digits": post("/generate", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}"),
        "nesting_100000": post("/generate", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"),
        "height_33": gen(params={**p, "height": 33}),
        "steps_20000": gen(params={**p, "num_steps": 20000}),
        "pixels_8192sq": gen(params={**p, "height": 8192, "width": 8192}),
        "params_0": gen(params=0),
        "png_bomb_image": gen(image=bomb),
        "prompt_2mb": gen(prompt="a red fox " * 200_000),
        "body_declared_10gb": http_request(
            "POST", "/generate", b"{}", {**AUTH, "content-length": str(10 << 30)}
        ),
        "wrong_token": post("/generate", b"{}", auth=False, authorization="Bearer nope"),
        "no_token_big_weights": http_request(
            "POST", "/update_weights?version=9", b"", {"content-length": str(1 << 30)}
        ),
        "half_bad_update": post("/update_weights?version=5", half_bad),
        "nan_update": post("/update_weights?version=5", nan_update),
        "version_1e3": post("/update_weights?version=1e3", nan_update),
        "unknown_path": http_request("GET", "/admin", headers=AUTH),
        "wrong_method": http_request("DELETE", "/generate", headers=AUTH),
        "half_sent_request": b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-le",
        "client_hangs_up": abandoned,
    }


def reward_malformed() -> dict[str, object]:
    red = png_b64((32, 32))
    bomb = png_b64((9000, 9000), mode="1", colour=0)
    big = png_b64((2000, 2000))

    def score(raw: bytes) -> bytes:
        return post("/score", raw)

    return {
        "garbage_bytes": b"\x00\x01\x02GARBAGE\r\n\r\n" + os.urandom(64),
        "bad_json": score(b"{not json"),
        "bad_utf8": score(b'{"prompts": ["\xff"]}'),
        "nan_reference": score(b'{"images": ["' + red.encode() + b'"], "references": [NaN]}'),
        "inf_reference": score(b'{"images": ["' + red.encode() + b'"], "references": [1e999]}'),
        "nesting_100000": score(b'{"metadata": ' + b"[" * 100000 + b"]" * 100000 + b"}"),
        "sample_rate_string": score(
            json.dumps({"prompts": ["x"], "sample_rate": "16000"}).encode()
        ),
        "sample_rate_5000_digits": score(
            b'{"prompts": ["x"], "sample_rate": ' + b"9" * 5000 + b"}"
        ),
        "png_bomb": score(json.dumps({"images": [bomb]}).encode()),
        "pixels_over_budget": score(json.dumps({"images": [big] * 10}).encode()),
        "bad_base64": score(json.dumps({"images": ["!!!"]}).encode()),
        "unknown_field": score(json.dumps({"imgs": [red]}).encode()),
        "no_samples": score(b"{}"),
        "body_declared_10gb": http_request(
            "POST", "/score", b"{}", {**AUTH, "content-length": str(10 << 30)}
        ),
        "wrong_token": post("/score", b"{}", auth=False, authorization="Bearer nope"),
        "unknown_path": http_request("GET", "/admin", headers=AUTH),
        "wrong_method": http_request("PUT", "/score", headers=AUTH),
        "half_sent_request": b"POST /score HTTP/1.1\r\nhost: x\r\n",
    }


#: kinds sent one at a time (within the burst): the server takes one weight update at a
#: time and answers others 429, so concurrent bad updates would mostly test that rule
SERIAL = ("half_bad_update", "nan_update", "version_1e3")


async def burst(port: int, kinds: dict[str, object], n: int) -> list[tuple[str, object, object]]:
    names = list(kinds)
    serial = asyncio.Lock()

    async def one(i: int):
        name = names[i % len(names)]
        what = kinds[name]
        if callable(what):
            status, kind = await what(port)
        elif name in SERIAL:
            async with serial:
                status, kind = await raw_exchange(port, what, wait_s=60)
        else:
            slow = name == "half_sent_request"
            status, kind = await raw_exchange(port, what, wait_s=READ_TIMEOUT_S * 3 if slow else 60)
        return name, status, kind

    return await asyncio.gather(*(one(i) for i in range(n)))


# ---------------------------------------------------------------------------- good clients
async def good_clients(
    url: str, clients: int, per_client: int, make_body
) -> tuple[Counter, list[float]]:
    import httpx

    statuses: Counter = Counter()
    latencies: list[float] = []

    # one pool with a connection per client: each client keeps its own connection alive
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300, limits=limits) as http:

        async def client(c: int) -> None:
            for r in range(per_client):
                t0 = time.monotonic()
                # as RolloutClient and HTTPReward do: a 429 is retried after its Retry-After,
                # a dropped kept-alive connection (closed idle by the server while this
                # overloaded client was slow to send) once on a new one
                dropped = 0
                for _ in range(30):
                    try:
                        resp = await http.post(
                            make_body.path, content=make_body(c * per_client + r)
                        )
                    except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
                        if dropped:
                            statuses[type(exc).__name__] += 1
                            break
                        dropped += 1
                        statuses[f"{type(exc).__name__} (retried)"] += 1
                        continue
                    except httpx.HTTPError as exc:
                        statuses[type(exc).__name__] += 1
                        break
                    if resp.status_code != 429:
                        statuses[resp.status_code] += 1
                        break
                    statuses["429 (retried)"] += 1
                    await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                latencies.append(time.monotonic() - t0)

        await asyncio.gather(*(client(c) for c in range(clients)))
    return statuses, latencies


def rollout_body(i: int) -> bytes:
    return json.dumps({"prompt": f"prompt {i % 97}", "seed": i, "params": ROLLOUT_PARAMS}).encode()


rollout_body.path = "/generate"  # type: ignore[attr-defined]
_RED = None


def reward_body(i: int) -> bytes:
    global _RED
    if _RED is None:
        _RED = png_b64((32, 32))
    return json.dumps({"images": [_RED], "prompts": [f"sample {i}"]}).encode()


reward_body.path = "/score"  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- prober
def probe_main(port: int, stop: str, out: str) -> None:
    """Separate process: GET /health on a fresh connection every 0.1 s until ``stop`` exists."""
    import socket

    lat, failed = [], 0
    while not Path(stop).exists():
        t0 = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                data = b""
                while chunk := s.recv(4096):
                    data += chunk
            if not data.startswith(b"HTTP/1.1 200"):
                failed += 1
            lat.append(time.monotonic() - t0)
        except OSError:
            failed += 1
        time.sleep(max(0.0, 0.1 - (time.monotonic() - t0)))
    Path(out).write_text(json.dumps({"latencies": lat, "failed": failed}))


# ---------------------------------------------------------------------------- one phase
def run_phase(name, argv, port, env, make_body, malformed, args, before=None, after=None) -> None:
    print(f"\n== {name}: {' '.join(argv[2:])}")
    proc = start(argv, port, env)
    try:
        base = memory_kib(proc.pid)
        url = f"http://127.0.0.1:{port}"
        ref = before(url) if before else None
        tmp = Path(tempfile.mkdtemp(prefix="soak-"))
        probe_out, stop = tmp / "probe.json", tmp / "stop"
        prober = subprocess.Popen(
            [sys.executable, __file__, "--probe", str(port), str(stop), str(probe_out)]
        )
        time.sleep(1.0)  # the prober is probing before the load starts

        async def main():
            load = asyncio.ensure_future(good_clients(url, args.clients, args.requests, make_body))
            await asyncio.sleep(1.0)
            bad = await burst(port, malformed, args.malformed)
            return await load, bad

        t0, cpu0 = time.monotonic(), cpu_s(proc.pid)
        (statuses, lat), bad = asyncio.run(main())
        wall, cpu = time.monotonic() - t0, cpu_s(proc.pid) - cpu0
        load = os.getloadavg()[0]
        check = after(url, ref) if after else None
        import httpx

        conn = httpx.get(f"{url}/stats", headers=AUTH, timeout=30).json().get("connections")
        stop.touch()
        prober.wait()
        probe = json.loads(probe_out.read_text())
        mem = memory_kib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    sent = args.clients * args.requests
    print(
        f"good requests: {statuses.get(200, 0)} of {sent} answered 200 in {wall:.1f} s "
        f"(latency counts retries); other answers: "
        f"{dict((k, v) for k, v in statuses.items() if k != 200) or 'none'}"
    )
    print(f"good latency s: p50 {pct(lat, 0.5):.3f}  p99 {pct(lat, 0.99):.3f}  max {max(lat):.3f}")
    hl = probe["latencies"]
    print(
        f"/health ({len(hl)} probes, {probe['failed']} failed) latency s: p50 {pct(hl, 0.5):.4f}"
        f"  p99 {pct(hl, 0.99):.4f}  max {max(hl) if hl else float('nan'):.4f}"
    )
    print(f"connection rules fired: {conn}")
    print(f"server CPU: {cpu:.1f} s over {wall:.1f} s of load (machine load average {load:.1f})")
    print(f"memory MiB: after start-up {base['VmRSS'] / 1024:.0f}, peak {mem['VmHWM'] / 1024:.0f}")
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for kind, status, jkind in bad:
        by_kind[kind][f"{status} {jkind}" if status else f"no answer ({jkind})"] += 1
    five = sum(1 for _, s, _ in bad if isinstance(s, int) and s >= 500)
    no4xx = sum(
        1 for k, s, _ in bad if k not in NOT_4XX and not (isinstance(s, int) and 400 <= s < 500)
    )
    print(
        f"malformed: {len(bad)} sent, {five} answered 5xx, {no4xx} without a 4xx "
        f"(not counted: {', '.join(f'{k} {v}' for k, v in NOT_4XX.items())})"
    )
    for kind in sorted(by_kind):
        print(f"  {kind:24s} {dict(by_kind[kind])}")
    if check is not None:
        print(check)


def rollout_before(url: str):
    import httpx

    from diffusion_rollout.wire import trajectory_from_bytes

    body = json.dumps({"prompt": "reference", "seed": 4242, "params": ROLLOUT_PARAMS})
    r = httpx.post(f"{url}/generate", content=body, headers=AUTH, timeout=120)
    return trajectory_from_bytes(r.content), body


def rollout_after(url: str, ref) -> str:
    import httpx
    import torch

    from diffusion_rollout.wire import trajectory_from_bytes

    traj, body = ref
    again = trajectory_from_bytes(
        httpx.post(f"{url}/generate", content=body, headers=AUTH, timeout=120).content
    )
    version = httpx.get(f"{url}/health", timeout=5).json()["version"]
    stats = httpx.get(f"{url}/stats", headers=AUTH, timeout=5).json()
    same = torch.equal(traj.final_latent, again.final_latent) and torch.equal(
        traj.log_probs, again.log_probs
    )
    return (
        f"reference trajectory bit-identical after the rejected updates: {same}; weights "
        f"version {version} (started at 0); requests stopped in the engine (client gone or "
        f"deadline): {stats['aborted']}; server counters: {stats['server']}"
    )


def tiny_sd3(path: str | None) -> str:
    if path:
        return path
    cache = Path.home() / ".cache" / "omni-rl-soak" / "tiny-sd3"
    if not (cache / "model_index.json").is_file():
        from omni_adapters import tiny

        print(f"building the tiny SD3 in {cache} (once)")
        tiny.build("sd3", cache, seed=0)
    return str(cache)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        probe_main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--requests", type=int, default=2, help="good requests per client")
    ap.add_argument("--malformed", type=int, default=300)
    ap.add_argument("--model", default=None, help="a saved tiny SD3 (built once if not given)")
    ap.add_argument("--only", choices=["rollout", "reward"], default=None)
    args = ap.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    print(
        f"soak: {args.clients} clients x {args.requests} good requests, a burst of "
        f"{args.malformed} malformed, /health probed every 0.1 s all along; "
        f"{os.cpu_count()} CPUs, 127.0.0.1 only"
    )
    common = ["--token", TOKEN, "--log-level", "critical"]  # every limit at its default
    if args.only in (None, "rollout"):
        port = free_port()
        model = tiny_sd3(args.model)
        argv = [
            sys.executable,
            "-m",
            "diffusion_rollout.cli",
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--max-num-seqs",
            "32",
            *common,
        ]
        run_phase(
            "diffusion-rollout serve",
            argv,
            port,
            env,
            rollout_body,
            rollout_malformed(model),
            args,
            rollout_before,
            rollout_after,
        )
    if args.only in (None, "reward"):
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "omni_rewards.cli",
            "serve",
            "brightness",
            "--port",
            str(port),
            *common,
        ]
        run_phase("omni-rewards serve", argv, port, env, reward_body, reward_malformed(), args)


if __name__ == "__main__":
    main()
