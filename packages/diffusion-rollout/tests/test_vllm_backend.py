"""VllmOmniEngine: request building and output parsing against vllm-omni's documented
structures (OmniDiffusionSamplingParams, DiffusionRequestBatch, DiffusionOutput,
OmniRequestOutput, LoRARequest), with a fake AsyncOmni that runs RolloutPipeline."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from diffusion_rollout import (
    EmbeddedEngine,
    RolloutRequest,
    SamplingParams,
    VersionMismatchError,
    VllmOmniEngine,
)
from diffusion_rollout.vllm_backend import (
    EXTRA_KEY,
    RolloutPipeline,
    build_omni_request,
    parse_omni_output,
    request_from_omni,
)

P = SamplingParams(
    height=16, width=16, num_steps=5, sde_window_size=2, guidance_scale=2.0, output="both"
)


@dataclasses.dataclass
class FakeSamplingParams:
    """The OmniDiffusionSamplingParams fields this backend sets (a subset of vllm-omni's)."""

    height: int | None = None
    width: int | None = None
    num_frames: int = 1
    num_inference_steps: int = 50
    guidance_scale: float = 0.0
    true_cfg_scale: float | None = None
    seed: int | None = None
    generator: Any = None
    num_outputs_per_prompt: int = 1
    lora_request: Any = None
    lora_scale: float = 1.0
    return_trajectory_latents: bool = False
    extra_args: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclasses.dataclass
class FakeOmniDiffusionRequest:
    prompt: Any
    sampling_params: Any
    request_id: str


@dataclasses.dataclass
class FakeRequestBatch:
    requests: list


@dataclasses.dataclass
class FakeOmniRequestOutput:
    """OmniRequestOutput.from_diffusion's fields."""

    request_id: str = ""
    images: list = dataclasses.field(default_factory=list)
    latents: Any = None
    trajectory_latents: Any = None
    trajectory_timesteps: Any = None
    trajectory_log_probs: Any = None
    custom_output: dict = dataclasses.field(default_factory=dict)
    error: str | None = None
    finished: bool = True


class FakeAsyncOmni:
    """AsyncOmni's surface: async-generator generate(prompt, request_id=, sampling_params_list=),
    add_lora / remove_lora. Runs RolloutPipeline one request per call, like a vllm-omni
    worker, with an internal uuid suffix on the request id."""

    def __init__(self, denoiser, gate: threading.Event | None = None):
        self.pipeline = RolloutPipeline(denoiser=denoiser)
        self.gate = gate
        self.added, self.removed, self.prompts = [], [], []

    async def generate(self, prompt, request_id="", *, sampling_params_list=None):
        (sp,) = sampling_params_list
        self.prompts.append(prompt)
        if self.gate is not None:
            await asyncio.to_thread(self.gate.wait, 10)
        batch = FakeRequestBatch([FakeOmniDiffusionRequest(prompt, sp, request_id + "-abcd1234")])
        out = await asyncio.to_thread(self.pipeline.forward, batch)
        yield FakeOmniRequestOutput(
            request_id=request_id,
            trajectory_latents=out.trajectory_latents,
            trajectory_timesteps=out.trajectory_timesteps,
            trajectory_log_probs=out.trajectory_log_probs,
            custom_output=out.custom_output,
        )

    async def add_lora(self, lora_request):
        self.added.append(lora_request)
        tensors = load_file(os.path.join(lora_request.lora_path, "adapter_model.safetensors"))
        self.pipeline.load_weights(tensors)
        return True

    async def remove_lora(self, adapter_id):
        self.removed.append(adapter_id)
        return True


def make_engine(toy, **kw):
    return VllmOmniEngine(
        omni=FakeAsyncOmni(toy, kw.pop("gate", None)),
        sampling_params_cls=FakeSamplingParams,
        lora_request_cls=FakeLoRARequest,
        lora_config={"r": 4, "lora_alpha": 4, "target_modules": ["to_q"]},
        **kw,
    )


def reqs(n, params=P):
    return [
        RolloutRequest(
            f"prompt {i}", 70 + i, params, f"v{i}", negative_prompt=None if i % 2 else "ugly"
        )
        for i in range(n)
    ]


def test_build_omni_request_fields():
    r = RolloutRequest("a cat", 42, P.replace(true_cfg_scale=3.0), "id7", negative_prompt="dog")
    prompt, sp = build_omni_request(
        r, version=3, lora_request="L", sampling_params_cls=FakeSamplingParams
    )
    assert prompt == {"prompt": "a cat", "negative_prompt": "dog"}
    assert (sp.height, sp.width, sp.num_frames, sp.num_inference_steps) == (16, 16, 1, 5)
    assert sp.guidance_scale == 2.0 and sp.true_cfg_scale == 3.0 and sp.seed == 42
    assert (
        sp.lora_request == "L" and sp.return_trajectory_latents and sp.num_outputs_per_prompt == 1
    )
    json.dumps(sp.extra_args)  # JSON-safe: it crosses process boundaries
    back, version = request_from_omni(sp)
    assert back == r and version == 3
    _, sp2 = build_omni_request(
        RolloutRequest("x", 1, P), version=0, sampling_params_cls=FakeSamplingParams
    )
    assert sp2.true_cfg_scale is None and "negative_prompt" not in _
    with pytest.raises(ValueError, match=EXTRA_KEY):
        request_from_omni(FakeSamplingParams())


def test_engine_matches_embedded(toy, toy_cls, max_diff):
    rs = reqs(4)
    with EmbeddedEngine(toy_cls()) as ref_engine:
        ref = ref_engine.generate_many(rs)
    with make_engine(toy) as engine:
        got = engine.generate_many(rs)
        assert engine.stats()["requests"] == 4
    for a, b in zip(ref, got):
        assert a.window == b.window and a.request_id == b.request_id
        assert max_diff(a, b) <= 1e-5
        assert torch.equal(a.media, b.media)
        assert a.condition.keys() == b.condition.keys()


def test_pipeline_batch_of_requests(toy, toy_cls, max_diff):
    """A DiffusionRequestBatch of several requests: one wave, per-request results."""
    rs = [*reqs(3), RolloutRequest("other size", 5, P.replace(height=32), "big")]
    batch = FakeRequestBatch(
        [
            FakeOmniDiffusionRequest(
                {"prompt": r.prompt},
                build_omni_request(r, version=0, sampling_params_cls=FakeSamplingParams)[1],
                f"internal-{i}",
            )
            for i, r in enumerate(rs)
        ]
    )
    pipe = RolloutPipeline(denoiser=toy)
    out = pipe.forward(batch)
    assert set(out.custom_output[EXTRA_KEY]) == {r.request_id for r in rs}
    assert out.trajectory_latents is None  # per-request data lives in custom_output
    with EmbeddedEngine(toy_cls()) as ref_engine:
        ref = ref_engine.generate_many(rs)
    for r, a in zip(rs, ref):
        b = parse_omni_output(r, FakeOmniRequestOutput(custom_output=out.custom_output), version=0)
        assert max_diff(a, b) <= 1e-5


def test_parse_output_variants_and_errors(toy):
    (r,) = reqs(1)
    pipe = RolloutPipeline(denoiser=toy)
    _, sp = build_omni_request(r, version=2, sampling_params_cls=FakeSamplingParams)
    out = pipe.forward(FakeRequestBatch([FakeOmniDiffusionRequest({}, sp, "x")]))
    entry = dict(out.custom_output[EXTRA_KEY][r.request_id])
    # window tensors from the trajectory_* fields, with a leading batch dim of 1, media from PIL-like arrays
    lean = {k: entry[k] for k in ("window", "condition")}
    o = FakeOmniRequestOutput(
        trajectory_latents=entry["latents"][None],
        trajectory_log_probs=entry["log_probs"][None],
        trajectory_timesteps=entry["sigmas"],
        latents=entry["final_latent"][None],
        images=[entry["media"].numpy()],
        custom_output={EXTRA_KEY: {"other-id": lean}},
    )
    t = parse_omni_output(r, o, version=2)
    assert t.latents.shape == entry["latents"].shape and t.version == 2
    assert torch.equal(t.final_latent, entry["final_latent"]) and torch.equal(
        t.media, entry["media"]
    )
    assert torch.equal(t.sigmas_next, entry["sigmas_next"])
    img = np.zeros((2, 2), dtype=np.float32)
    o.images = [img]
    assert parse_omni_output(r, o, version=2).media.shape == (2, 2, 3)
    with pytest.raises(RuntimeError, match="boom"):
        parse_omni_output(r, FakeOmniRequestOutput(error="boom"), version=0)
    with pytest.raises(ValueError, match="pipeline_class"):
        parse_omni_output(r, FakeOmniRequestOutput(), version=0)
    bad = dict(
        lean, latents=entry["latents"][:-1], log_probs=entry["log_probs"], sigmas=entry["sigmas"]
    )
    with pytest.raises(ValueError, match="needs 3 latents"):
        parse_omni_output(
            r, FakeOmniRequestOutput(custom_output={EXTRA_KEY: {r.request_id: bad}}), version=0
        )


def test_lora_update_is_versioned_and_atomic(toy):
    gate = threading.Event()
    engine = make_engine(toy, gate=gate)
    try:
        old = engine._submit(engine._generate(RolloutRequest("x", 1, P, "old")))
        new_w = {"proj_out.bias": torch.full((4,), 0.2)}
        upd = engine._submit(engine._update(new_w, 1))
        pinned = engine._submit(
            engine._generate(RolloutRequest("x", 1, P.replace(weights_version=1), "pin"))
        )
        import time

        time.sleep(0.1)
        assert not upd.done()  # waits for the old version's request in flight
        assert engine.omni.added and engine.version == 1  # new requests already use v1
        gate.set()
        assert old.result(10).version == 0
        upd.result(10)
        assert pinned.result(10).version == 1
        (lora,) = engine.omni.added
        assert (lora.lora_name, lora.lora_int_id) == ("rollout-v1", 2)
        assert engine.omni.removed == []  # version 0 is the base model: nothing to remove
        with open(os.path.join(lora.lora_path, "adapter_config.json")) as f:
            cfg = json.load(f)
        assert cfg["peft_type"] == "LORA" and cfg["r"] == 4
        engine.update_weights({"proj_out.bias": torch.full((4,), 0.1)}, 2)
        assert engine.omni.removed == [2] and engine.stats()["lora_versions"] == [2]
        assert engine.omni.prompts[-1] == {"prompt": "x"}
        _, sp = build_omni_request(
            RolloutRequest("x", 1, P),
            version=2,
            lora_request=engine._loras[2],
            sampling_params_cls=FakeSamplingParams,
        )
        assert sp.lora_request.lora_int_id == 3
        with pytest.raises(ValueError, match="not newer"):
            engine.update_weights(new_w, 2)
        with pytest.raises(VersionMismatchError, match="engine is at version 2"):
            engine.generate_many([RolloutRequest("x", 1, P.replace(weights_version=1))])
    finally:
        gate.set()
        engine.close()


def test_future_version_times_out(toy):
    with (
        make_engine(toy, version_timeout_s=0.05) as engine,
        pytest.raises(VersionMismatchError, match=r"within 0\.05 s"),
    ):
        engine.generate_many([RolloutRequest("x", 1, P.replace(weights_version=9))])


def test_async_generate(toy):
    with make_engine(toy) as engine:

        async def main():
            return await asyncio.gather(*(engine.generate(r) for r in reqs(2)))

        out = asyncio.run(main())
    assert [t.request_id for t in out] == ["v0", "v1"]


def test_needs_model_or_omni():
    with pytest.raises(ValueError, match="model"):
        VllmOmniEngine()


@pytest.mark.gpu
def test_vllm_omni_gpu_rollout():
    """Real run: needs CUDA, vllm-omni and DIFFUSION_ROLLOUT_VLLM_MODEL (a local SD3 folder)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm_omni")
    model = os.environ.get("DIFFUSION_ROLLOUT_VLLM_MODEL")
    if not model:
        pytest.skip("set DIFFUSION_ROLLOUT_VLLM_MODEL to a local model folder")
    params = SamplingParams(height=512, width=512, num_steps=10, sde_window_size=2)
    with VllmOmniEngine(model) as engine:
        trajs = engine.generate_many(
            [RolloutRequest("a cat", i, params, f"g{i}") for i in range(4)]
        )
    for t in trajs:
        assert t.latents.shape[0] == 3 and t.log_probs.shape == (2,)
        assert torch.isfinite(t.log_probs).all()
