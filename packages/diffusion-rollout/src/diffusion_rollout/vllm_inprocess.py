"""vllm-omni's diffusion engine served in this process, on a CPU.

`VllmOmniEngine` talks to vllm-omni's ``AsyncOmni`` through two methods, ``generate`` and
``collective_rpc``. `InProcessOmni` answers both here, with vllm-omni's own code on each side
of our pipeline: every call is bound to the real ``AsyncOmni`` method's signature; the engine
config is vllm-omni's ``OmniDiffusionConfig``; its model loader builds `RolloutPipeline` as a
custom pipeline; each request runs as a vllm-omni request batch, through the runner's output
check and the engine's post-process into ``OmniRequestOutput``; collective RPCs run on the
worker class vllm-omni builds for our worker extension. What is left out is vllm-omni's GPU
executor (worker processes, the CUDA platform, its scheduler), so requests run one at a time.

For tests and for debugging a pipeline on a machine without a GPU::

    from diffusion_rollout.vllm_backend import engine_args
    omni = in_process_omni(**engine_args(model, lora_config=lora))
    engine = VllmOmniEngine(omni=omni)

Needs vllm-omni (``pip install 'diffusion-rollout[vllm-omni]'``); vllm-omni 0.30 and vLLM 0.30
import on a CPU-only machine for everything used here (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any

import torch
from vllm.config import LoadConfig
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.diffusion_model_runner import (
    DiffusionModelRunner,
    # the runner's own check of a pipeline's outputs (one per request of a batch)
    _normalize_pipeline_outputs,
)
from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker, WorkerWrapperBase
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.entrypoints.async_omni import AsyncOmni
from vllm_omni.outputs import OmniRequestOutput

__all__ = [
    "InProcessOmni",
    "check_outputs",
    "engine_config",
    "extended_worker",
    "in_process_omni",
    "load_pipeline",
    "post_processor",
]


def engine_config(omni_kwargs: dict[str, Any]) -> OmniDiffusionConfig:
    """vllm-omni's engine config for ``AsyncOmni(**omni_kwargs)`` (`engine_args`' keys: model,
    custom_pipeline_args, model_class_name, dtype, max_num_seqs)."""
    dtype = omni_kwargs.get("dtype", "float32")
    return OmniDiffusionConfig.from_kwargs(
        model=omni_kwargs["model"],
        custom_pipeline_args=omni_kwargs["custom_pipeline_args"],
        model_class_name=omni_kwargs["model_class_name"],
        dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
        max_num_seqs=omni_kwargs.get("max_num_seqs", 16),
    )


def load_pipeline(od: OmniDiffusionConfig) -> torch.nn.Module:
    """The custom pipeline as vllm-omni's worker loads it, on the CPU."""
    loader = DiffusersPipelineLoader(LoadConfig(), od)
    return loader.load_model(
        load_device="cpu",
        load_format="custom_pipeline",
        custom_pipeline_name=od.custom_pipeline_args["pipeline_class"],
        device=torch.device("cpu"),
    )


def post_processor(od: OmniDiffusionConfig) -> DiffusionEngine:
    """vllm-omni's engine, only for its conversion of a ``DiffusionOutput`` into
    ``OmniRequestOutput``s with the post-process hooks it resolves for ``od`` (built with
    ``object.__new__``: no executor)."""
    engine = object.__new__(DiffusionEngine)
    engine.od_config = od
    engine._init_process_hooks(od)
    return engine


def check_outputs(raw: Any, count: int) -> list[Any]:
    """The runner's check that a request batch's forward returned one output per request."""
    return _normalize_pipeline_outputs(
        raw, expected_count=count, allow_single_output=False, pipeline_name="RolloutPipeline"
    )


def extended_worker(pipeline: torch.nn.Module, extension_cls: str | None = None) -> Any:
    """A worker of the class vllm-omni builds for ``worker_extension_cls`` (its
    ``DiffusionWorker`` with our extension mixed in), holding ``pipeline`` (no device setup)."""
    from .vllm_backend import WORKER_EXTENSION_CLASS

    wrapper = object.__new__(WorkerWrapperBase)
    wrapper.base_worker_class = DiffusionWorker
    wrapper.worker_extension_cls = extension_cls or WORKER_EXTENSION_CLASS
    wrapper.uses_custom_pipeline = True
    cls = wrapper._prepare_worker_class()
    worker = object.__new__(cls)
    runner = object.__new__(DiffusionModelRunner)  # vllm-omni's runner, without device setup
    runner.pipeline = pipeline
    worker.model_runner = runner
    return worker


class InProcessOmni:
    """``AsyncOmni.generate`` and ``collective_rpc`` served in this process (module docstring).

    ``gate``: when given, each request waits for it to be set before it runs (tests hold
    requests in flight with it). ``rpcs`` lists the RPC methods called, in order."""

    def __init__(
        self,
        pipeline: torch.nn.Module,
        engine: DiffusionEngine,
        gate: threading.Event | None = None,
        worker_extension_cls: str | None = None,
    ) -> None:
        self.pipeline, self.engine, self.gate = pipeline, engine, gate
        self.worker = extended_worker(pipeline, worker_extension_cls)
        self.rpcs: list[str] = []

    async def generate(self, *args: Any, **kwargs: Any):
        call = inspect.signature(AsyncOmni.generate).bind(self, *args, **kwargs).arguments
        (sp,) = call["sampling_params_list"]
        # vllm-omni's orchestrator gives the engine request an id of its own
        req = OmniDiffusionRequest(call["prompt"], sp, request_id=call["request_id"] + "-9c1e")
        if self.gate is not None:
            await asyncio.to_thread(self.gate.wait, 10)

        def run() -> list[Any]:
            with torch.inference_mode():
                raw = self.pipeline.forward(DiffusionRequestBatch([req]))
            return check_outputs(raw, 1)

        (out,) = await asyncio.to_thread(run)
        (inner,) = self.engine.postprocess_output(req, out)
        yield OmniRequestOutput.from_stage_output(
            inner, request_id=call["request_id"], finished=True, stage_id=0
        )

    async def collective_rpc(self, *args: Any, **kwargs: Any) -> list[Any]:
        call = inspect.signature(AsyncOmni.collective_rpc).bind(self, *args, **kwargs).arguments
        self.rpcs.append(call["method"])
        method = getattr(self.worker, call["method"])
        return [await asyncio.to_thread(method, *call.get("args", ()))]


def in_process_omni(**omni_kwargs: Any) -> InProcessOmni:
    """What ``AsyncOmni(**omni_kwargs)`` would serve, in this process (`engine_args` gives the
    arguments; its test checks that vllm-omni reads each of them): `engine_config`,
    `load_pipeline` and `post_processor` build the engine's pieces."""
    od = engine_config(omni_kwargs)
    return InProcessOmni(
        load_pipeline(od), post_processor(od), None, omni_kwargs.get("worker_extension_cls")
    )
