"""The vllm-omni backend against vllm-omni's own code (the release uv.lock pins, 0.30).

Runs in the lock's vllm-omni environment (``nox -s tests-vllm-omni``): vllm-omni and vLLM
import on a CPU-only machine (all of vllm_omni but its CUDA platform and a few model packages,
see docs/scaling.md), so everything below is vllm-omni's real code: its sampling params,
request, request batch and ``DiffusionOutput`` classes, its engine config
(``OmniDiffusionConfig``) and registry look-ups, its model loader building our pipeline, the
runner's check of a pipeline's outputs, the engine's post-process into ``OmniRequestOutput``,
its worker-extension mechanism, and ``AsyncOmni``'s signatures. Only the GPU engine itself does
not run here (benchmarks/device/vllm_omni_parity.sh runs it). Where vllm-omni is not installed
(the default workspace, the standalone wheel) the module is skipped.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
import threading
import time

import pytest
import torch

pytest.importorskip("vllm_omni.diffusion.data")
omni_adapters = pytest.importorskip("omni_adapters")

from vllm_omni.diffusion.data import DiffusionOutput  # noqa: E402
from vllm_omni.diffusion.diffusion_engine import supports_request_batch  # noqa: E402
from vllm_omni.diffusion.registry import (  # noqa: E402
    get_diffusion_post_process_func,
    get_diffusion_pre_process_func,
)
from vllm_omni.diffusion.request import OmniDiffusionRequest  # noqa: E402
from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker  # noqa: E402
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch  # noqa: E402
from vllm_omni.inputs.data import OmniDiffusionSamplingParams  # noqa: E402
from vllm_omni.outputs import OmniRequestOutput  # noqa: E402

from diffusion_rollout import (  # noqa: E402
    EmbeddedEngine,
    RolloutRequest,
    SamplingParams,
    VersionMismatchError,
    VllmOmniEngine,
)
from diffusion_rollout.vllm_backend import (  # noqa: E402
    EXTRA_KEY,
    LOAD_METHOD,
    MODEL_CLASS_NAME,
    PIPELINE_CLASS,
    WORKER_EXTENSION_CLASS,
    build_omni_request,
    engine_args,
    parse_omni_output,
    request_from_omni,
)
from diffusion_rollout.vllm_inprocess import (  # noqa: E402
    InProcessOmni,
    check_outputs,
    engine_config,
    load_pipeline,
    post_processor,
)
from diffusion_rollout.vllm_worker import RolloutPipeline, RolloutWorkerExtension  # noqa: E402

P = SamplingParams(
    height=32,
    width=32,
    num_steps=4,
    guidance_scale=3.0,
    sde_window_size=2,
    sde_window_range=(0, 3),
    output="both",
)
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["to_q", "to_v"]}


def reqs(n, params=P, prefix="r"):
    return [
        RolloutRequest(
            f"prompt {i}", 70 + i, params, f"{prefix}{i}", negative_prompt="ugly" if i % 2 else None
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def tiny_sd3():
    return str(omni_adapters.tiny.build("sd3", tempfile.mkdtemp() + "/tiny-sd3"))


def od_config(model, lora=None):
    """vllm-omni's engine config, built from the arguments `VllmOmniEngine` starts with."""
    return engine_config(engine_args(model, lora_config=lora, max_num_seqs=8))


def run_batch(pipeline, engine, requests, version=0):
    """One request batch through the pipeline as the runner runs it (inference mode, the
    runner's output check), then the engine's post-process and the orchestrator's wrapping."""
    omni_reqs = [
        OmniDiffusionRequest(
            prompt=build_omni_request(r, version=version)[0],
            sampling_params=build_omni_request(r, version=version)[1],
            request_id=f"{r.request_id}-0f3a",
        )
        for r in requests
    ]
    batch = DiffusionRequestBatch(requests=omni_reqs)
    with torch.inference_mode():
        raw = pipeline.forward(batch)
    outs = check_outputs(raw, len(omni_reqs))
    wrapped = []
    for req, out in zip(omni_reqs, outs):
        (inner,) = engine.postprocess_output(req, out)
        wrapped.append(
            OmniRequestOutput.from_stage_output(
                inner, request_id=req.request_id, finished=True, stage_id=0
            )
        )
    return wrapped


def max_diff(a, b):
    d = 0.0
    for name in ("latents", "log_probs", "sigmas", "sigmas_next", "final_latent"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape, name
        d = max(d, (x.double() - y.double()).abs().max().item())
    return d


@pytest.fixture(scope="module")
def served(tiny_sd3):
    od = od_config(tiny_sd3)
    return od, load_pipeline(od), post_processor(od)


def test_sampling_params_and_request_are_vllm_omnis():
    r = RolloutRequest("a cat", 42, P.replace(true_cfg_scale=3.0), "id7", negative_prompt="dog")
    prompt, sp = build_omni_request(r, version=3)
    assert isinstance(sp, OmniDiffusionSamplingParams)
    assert prompt == {"prompt": "a cat", "negative_prompt": "dog"}
    assert (sp.height, sp.width, sp.num_frames, sp.num_inference_steps) == (32, 32, 1, 4)
    assert sp.guidance_scale == 3.0 and sp.true_cfg_scale == 3.0 and sp.seed == 42
    json.dumps(sp.extra_args)  # JSON-safe: it crosses processes
    req = OmniDiffusionRequest(prompt=prompt, sampling_params=sp, request_id="id7-x")
    assert req.sampling_params.guidance_scale_provided  # vllm-omni's own request bookkeeping
    assert request_from_omni(req.sampling_params) == (r, 3)
    with pytest.raises(ValueError, match=EXTRA_KEY):
        request_from_omni(OmniDiffusionSamplingParams())


def test_engine_config_runs_our_pipeline_batched(served):
    od, pipeline, _ = served
    assert od.model_class_name == MODEL_CLASS_NAME
    assert od.custom_pipeline_args["pipeline_class"] == PIPELINE_CLASS
    assert supports_request_batch(od)  # the engine will co-batch requests for it
    # no family hook rewrites the rollout envelope (the tiny folder says StableDiffusion3Pipeline)
    assert get_diffusion_post_process_func(od) is None
    assert get_diffusion_pre_process_func(od) is None
    assert isinstance(pipeline, RolloutPipeline) and isinstance(pipeline, torch.nn.Module)
    names = {n for n, _ in pipeline.named_parameters()}
    assert any(n.startswith("transformer.") for n in names) and pipeline.weights_sources == []


def test_request_batch_matches_embedded_engine(served, tiny_sd3):
    """Requests of two sizes in one batch: one output per request, in order, through vllm-omni's
    post-process, equal to the embedded engine's trajectories."""
    _, pipeline, engine = served
    rs = [*reqs(3), *reqs(2, P.replace(height=48), "big")]
    got = [
        parse_omni_output(r, o, version=0)
        for r, o in zip(rs, run_batch(pipeline, engine, rs), strict=True)
    ]
    with EmbeddedEngine(omni_adapters.from_pretrained(tiny_sd3)) as ref_engine:
        ref = ref_engine.generate_many(rs)
    for a, b in zip(ref, got):
        assert a.request_id == b.request_id and a.window == b.window
        assert max_diff(a, b) <= 1e-5
        assert torch.equal(a.media, b.media) and b.media.dtype == torch.uint8
        assert a.condition.keys() == b.condition.keys()
        assert not b.latents.is_inference()  # usable in the trainer's autograd replay


def test_runner_rejects_a_single_output_for_a_batch(served):
    _, pipeline, _ = served
    rs = reqs(2)
    batch = DiffusionRequestBatch(
        [
            OmniDiffusionRequest(*build_omni_request(r, version=0), request_id=r.request_id)
            for r in rs
        ]
    )
    outs = pipeline.forward(batch)
    assert isinstance(outs, list) and len(outs) == 2
    with pytest.raises(RuntimeError, match="request-batch forward must return list"):
        check_outputs(outs[0], 2)


def test_startup_warmup_request_gets_an_empty_output(served):
    """vllm-omni's own startup warmup request (512 px, no rollout data) must not fail."""
    _, pipeline, engine = served
    dummy = engine._make_dummy_request(
        height=512, width=512, guidance_scale=0.0, num_inference_steps=2
    )
    (out,) = pipeline.forward(DiffusionRequestBatch([dummy]))
    assert isinstance(out, DiffusionOutput) and out.error is None and out.output is None
    dummy.request_id = "not-a-warmup"  # any other request without rollout data is refused
    with pytest.raises(ValueError, match=r"must come from diffusion_rollout\.VllmOmniEngine"):
        pipeline.forward(DiffusionRequestBatch([dummy]))


def test_output_errors_name_the_cause(served):
    (r,) = reqs(1)
    with pytest.raises(RuntimeError, match="boom"):
        parse_omni_output(r, OmniRequestOutput.from_error(r.request_id, "boom"), version=0)
    bare = OmniRequestOutput.from_diffusion(request_id=r.request_id, images=[])
    with pytest.raises(ValueError, match="pipeline_class"):
        parse_omni_output(r, bare, version=0)


@pytest.fixture(scope="module")
def served_lora(tiny_sd3):
    od = od_config(tiny_sd3, lora=LORA)
    return od, load_pipeline(od), post_processor(od)


def lora_weights(tiny_sd3, seed):
    """LoRA tensors as the trainer exports them (omni-adapters, same config), nonzero B."""
    adapter = omni_adapters.from_pretrained(tiny_sd3)
    adapter.add_lora(LORA["rank"], LORA["alpha"], target_modules=LORA["target_modules"])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.trainable_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return adapter.export_rollout_weights()


def test_engine_syncs_lora_versions_through_the_worker(served_lora, tiny_sd3):
    """VllmOmniEngine over AsyncOmni's interface: LoRA updates load through the worker RPC into
    the pipeline, requests in flight finish on the old version, pinned requests wait, and the
    trajectories equal the embedded engine's with the same weights."""
    _, pipeline, engine = served_lora
    gate = threading.Event()
    omni = InProcessOmni(pipeline, engine, gate)
    # the worker class vllm-omni builds for our extension, with the hook it calls at load
    assert isinstance(omni.worker, DiffusionWorker)
    assert isinstance(omni.worker, RolloutWorkerExtension)
    assert callable(omni.worker.re_init_pipeline)
    w1, w2 = lora_weights(tiny_sd3, 1), lora_weights(tiny_sd3, 2)
    ref_model = omni_adapters.from_pretrained(tiny_sd3)
    ref_model.add_lora(LORA["rank"], LORA["alpha"], target_modules=LORA["target_modules"])
    with VllmOmniEngine(omni=omni) as eng, EmbeddedEngine(ref_model) as ref:
        old = eng._submit(eng._generate(RolloutRequest("x", 1, P, "old")))
        time.sleep(0.2)
        upd = eng._submit(eng._update(w1, 1))
        pinned = eng._submit(
            eng._generate(RolloutRequest("x", 1, P.replace(weights_version=1), "pin"))
        )
        time.sleep(0.2)
        assert not upd.done() and omni.rpcs == []  # waits for the request in flight
        gate.set()
        assert old.result(30).version == 0
        upd.result(30)
        assert omni.rpcs == [LOAD_METHOD] and eng.version == 1
        got1 = pinned.result(30)
        ref.update_weights(w1, 1)
        (want1,) = ref.generate_many([RolloutRequest("x", 1, P.replace(weights_version=1), "pin")])
        assert got1.version == 1 and max_diff(got1, want1) <= 1e-5
        eng.update_weights(w2, 2)
        ref.update_weights(w2, 2)
        got2, want2 = eng.generate_many(reqs(2)), ref.generate_many(reqs(2))
        assert all(g.version == 2 for g in got2)
        assert max(max_diff(a, b) for a, b in zip(got2, want2)) <= 1e-5
        assert max_diff(got1, got2[0]) > 1e-3  # the new LoRA changed the samples
        with pytest.raises(ValueError, match="not newer"):
            eng.update_weights(w2, 2)
        with pytest.raises(VersionMismatchError, match="engine is at version 2"):
            eng.generate_many([RolloutRequest("x", 1, P.replace(weights_version=1))])
        with pytest.raises(ValueError, match="unknown tensor names"):
            eng.update_weights({"not.a.weight": torch.zeros(1)}, 3)
        assert eng.version == 2 and eng.stats()["updates"] == 2
        assert not os.listdir(eng.weights_dir)  # update files are removed once loaded


def test_future_version_times_out(served):
    _, pipeline, engine = served
    with (
        VllmOmniEngine(omni=InProcessOmni(pipeline, engine), version_timeout_s=0.05) as eng,
        pytest.raises(VersionMismatchError, match=r"within 0\.05 s"),
    ):
        eng.generate_many([RolloutRequest("x", 1, P.replace(weights_version=9))])


def test_engine_args_are_async_omni_arguments(tiny_sd3):
    """`engine_args` names only arguments vllm-omni's engine reads for a diffusion stage."""
    args = engine_args(tiny_sd3, lora_config=LORA, num_gpus=1)
    assert args["custom_pipeline_args"] == {"pipeline_class": PIPELINE_CLASS, "lora": LORA}
    assert args["worker_extension_cls"] == WORKER_EXTENSION_CLASS
    src = inspect.getsource(
        __import__("vllm_omni.engine.omni_engine_base", fromlist=["x"])
    )  # the default diffusion stage is built from these kwargs
    for key in args:
        if key != "model":
            assert f'"{key}"' in src, key
    with pytest.raises(ValueError, match="model"):
        VllmOmniEngine()
