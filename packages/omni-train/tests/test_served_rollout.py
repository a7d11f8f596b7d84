"""`diffusion-rollout serve --model <tiny SD3>` with the real omni-adapters loader: a rejected
weight update (even the very first, before the engine knows any shapes) changes nothing, and
requests the model cannot run are 400s naming the field (loopback only)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import torch


@pytest.fixture
def served(tiny_sd3):
    uvicorn = pytest.importorskip("uvicorn")  # diffusion-rollout's server extra

    from diffusion_rollout.cli import build_parser, build_server
    from diffusion_rollout.serving import uvicorn_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = build_parser().parse_args(["serve", "--model", str(tiny_sd3), "--port", str(port)])
    app, engine = build_server(args)  # the default loader: omni_adapters.from_pretrained
    server = uvicorn.Server(
        uvicorn_config(app, host="127.0.0.1", port=port, limits=app.state.limits.http)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(10)
    engine.close()


def test_rejected_first_update_changes_nothing(served):
    from diffusion_rollout.wire import tensors_to_bytes, trajectory_from_bytes

    url, engine = served
    params = {"height": 32, "width": 32, "num_steps": 4, "guidance_scale": 4.5}
    gen = json.dumps({"prompt": "a red fox", "seed": 7, "params": params}).encode()
    http = httpx.Client(base_url=url, timeout=120)
    before = trajectory_from_bytes(http.post("/generate", content=gen).content)
    own = dict(engine.denoiser.model.named_parameters())
    first, last = sorted(own)[0], sorted(own)[-1]
    good = own[first].detach() + 1.0  # sorted first: the old loader copied it before failing
    for bad in (torch.zeros(3, 3), torch.full_like(own[last].detach(), float("nan"))):
        body = tensors_to_bytes({first: good, last: bad})
        r = http.post("/update_weights?version=1", content=body)
        assert r.status_code == 400 and r.json()["field"] == last, r.text
    assert http.get("/health").json()["version"] == 0
    after = trajectory_from_bytes(http.post("/generate", content=gen).content)
    assert torch.equal(before.final_latent, after.final_latent)
    assert torch.equal(before.log_probs, after.log_probs)
    for change, field in [
        ({"height": 33}, "params.height"),
        ({"num_frames": 5}, "params.num_frames"),
    ]:
        bad = json.dumps({"prompt": "x", "seed": 1, "params": {**params, **change}}).encode()
        r = http.post("/generate", content=bad)
        assert r.status_code == 400 and r.json()["field"] == field, r.text
    r = http.post("/update_weights?version=1", content=tensors_to_bytes({first: good}))
    assert r.status_code == 200, r.text
    changed = trajectory_from_bytes(http.post("/generate", content=gen).content)
    assert changed.version == 1 and not torch.equal(before.final_latent, changed.final_latent)


def test_engine_rejects_a_half_bad_first_update_whole(tiny_sd3):
    """In process (no server extra needed): the engine knows no shapes before its first
    update, so the adapter's own check-before-copy is what keeps the good tensor out."""
    from diffusion_rollout import EmbeddedEngine, RolloutRequest, SamplingParams
    from omni_adapters import from_pretrained

    denoiser = from_pretrained(tiny_sd3)
    own = dict(denoiser.model.named_parameters())
    first, last = sorted(own)[0], sorted(own)[-1]
    before = {k: v.detach().clone() for k, v in own.items()}
    params = SamplingParams(height=32, width=32, num_steps=3, output="latent")
    with EmbeddedEngine(denoiser) as engine:
        (a,) = engine.generate_many([RolloutRequest("a fox", 3, params)])
        with pytest.raises(ValueError, match=last.replace(".", r"\.")):
            engine.update_weights({first: own[first].detach() + 1, last: torch.zeros(2)}, 1)
        (b,) = engine.generate_many([RolloutRequest("a fox", 3, params)])
        assert engine.version == 0
    assert all(torch.equal(before[k], v) for k, v in own.items())
    assert torch.equal(a.final_latent, b.final_latent)
