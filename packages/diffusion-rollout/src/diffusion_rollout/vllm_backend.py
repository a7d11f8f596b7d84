"""`VllmOmniEngine`: the engine interface over vllm-omni's ``AsyncOmni`` (extra ``vllm-omni``).

vllm-omni schedules the requests and co-batches compatible ones on its GPU workers; this
module adapts it to our request / trajectory contract (the worker side is
:mod:`diffusion_rollout.vllm_worker`):

- one ``AsyncOmni.generate(prompt, request_id=..., sampling_params_list=[sp])`` per sample,
  with the integer ``seed`` and the sizes on ``OmniDiffusionSamplingParams`` and the RL knobs
  (the whole `RolloutRequest` as JSON plus the weights version) in
  ``sp.extra_args["diffusion_rollout"]`` (:func:`build_omni_request`);
- the engine is started with ``custom_pipeline_args.pipeline_class`` =
  :data:`PIPELINE_CLASS` (it runs the same wave loop as `EmbeddedEngine` on the worker),
  ``worker_extension_cls`` = :data:`WORKER_EXTENSION_CLASS` (the weight-sync RPC) and
  ``model_class_name`` = :data:`MODEL_CLASS_NAME` (no family post-process rewrites the output);
- :func:`parse_omni_output` turns the ``OmniRequestOutput`` back into a `Trajectory`: window
  tensors from ``trajectory_latents`` / ``trajectory_log_probs`` / ``trajectory_timesteps``,
  media from ``images``, the rest from ``multimodal_output["metadata"]["diffusion_rollout"]``;
- weights: ``update_weights(tensors, version)`` stops admitting requests, waits for the ones in
  flight (they finish on the old weights), writes the tensors to one safetensors file, has
  every worker load it (``AsyncOmni.collective_rpc("load_rollout_weights", args=(path,))`` ->
  ``pipeline.load_weights``, the way verl-omni's workers sync weights), then moves to the new
  version and admits requests again. A rollout never mixes two versions. LoRA tensors need the
  adapter configured at start (``lora_config``), as the pipeline adds it at load time.

vllm-omni is imported lazily, only when an ``AsyncOmni`` or its sampling-params class is
needed, so this module imports without it. Tests run against vllm-omni's own classes in the
lock's vllm-omni environment (``nox -s tests-vllm-omni``); the GPU run is
benchmarks/device/vllm_omni_parity.sh.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .params import RolloutRequest
from .types import RequestAborted, Trajectory, VersionMismatchError

__all__ = [
    "EXTRA_KEY",
    "LOAD_METHOD",
    "MODEL_CLASS_NAME",
    "PIPELINE_CLASS",
    "WORKER_EXTENSION_CLASS",
    "VllmOmniEngine",
    "build_omni_request",
    "engine_args",
    "parse_omni_output",
    "request_from_omni",
]

EXTRA_KEY = "diffusion_rollout"
PIPELINE_CLASS = "diffusion_rollout.vllm_worker.RolloutPipeline"
WORKER_EXTENSION_CLASS = "diffusion_rollout.vllm_worker.RolloutWorkerExtension"
#: a pipeline class name vllm-omni registers no pre- or post-process for
MODEL_CLASS_NAME = "DiffusionRolloutPipeline"
#: the worker RPC that loads a safetensors file into the pipeline
LOAD_METHOD = "load_rollout_weights"


def _vllm_omni(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ImportError(
            f"VllmOmniEngine needs vllm-omni (pip install 'diffusion-rollout[vllm-omni]'): {exc}"
        ) from None


def build_omni_request(
    request: RolloutRequest, *, version: int, sampling_params_cls: Any = None
) -> tuple[dict[str, Any], Any]:
    """The ``(prompt, OmniDiffusionSamplingParams)`` pair for one sample.

    ``prompt`` is an ``OmniTextPrompt`` dict (``prompt``, ``negative_prompt``). The sampling
    params carry height, width, num_frames, num_inference_steps, guidance_scale,
    true_cfg_scale, the integer ``seed``, one output, and ``extra_args["diffusion_rollout"] =
    {"request": request.to_dict(), "version": version}`` (JSON: it crosses processes). Every
    field is passed by name, so a field vllm-omni does not have is a TypeError here.
    """
    if sampling_params_cls is None:
        sampling_params_cls = _vllm_omni("vllm_omni.inputs.data", "OmniDiffusionSamplingParams")
    p = request.params
    prompt: dict[str, Any] = {"prompt": request.prompt}
    if request.negative_prompt is not None:
        prompt["negative_prompt"] = request.negative_prompt
    sp = sampling_params_cls(
        height=p.height,
        width=p.width,
        num_frames=p.num_frames,
        num_inference_steps=p.num_steps,
        guidance_scale=p.guidance_scale,
        true_cfg_scale=p.true_cfg_scale if p.true_cfg_scale > 1 else None,
        seed=request.seed,
        num_outputs_per_prompt=1,
        extra_args={EXTRA_KEY: {"request": request.to_dict(), "version": int(version)}},
    )
    return prompt, sp


def request_from_omni(sampling_params: Any) -> tuple[RolloutRequest, int]:
    """Inverse of :func:`build_omni_request` on the worker side: (request, version)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    if EXTRA_KEY not in extra:
        raise ValueError(
            f"sampling_params.extra_args has no {EXTRA_KEY!r} entry: requests for RolloutPipeline "
            "must come from diffusion_rollout.VllmOmniEngine"
        )
    data = extra[EXTRA_KEY]
    return RolloutRequest.from_dict(data["request"]), int(data.get("version", 0))


def _tensor(value: Any, name: str, request_id: str) -> Tensor:
    """A plain (not inference-mode) float32 copy: vllm-omni runs its pipelines under
    ``torch.inference_mode``, and the trainer replays these tensors with autograd on."""
    if value is None:
        raise ValueError(f"output for {request_id!r} has no {name}")
    return torch.as_tensor(value).detach().to(torch.float32).clone()


def _media(images: Any) -> Tensor | None:
    """The first of ``OmniRequestOutput.images`` as uint8 channels-last (our pipeline puts a
    uint8 tensor there; PIL images and float arrays in [0, 1] are converted)."""
    if not images:
        return None
    first = images[0]
    if isinstance(first, Tensor):
        return first.detach().to(torch.uint8).clone()
    arr = np.asarray(first)
    if arr.dtype != np.uint8:
        arr = np.clip(np.rint(arr * 255.0 if arr.max() <= 1.0 else arr), 0, 255).astype(np.uint8)
    if arr.ndim == 2:
        arr = np.repeat(arr[..., None], 3, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(arr[..., :3]))


def parse_omni_output(request: RolloutRequest, output: Any, *, version: int) -> Trajectory:
    """An ``OmniRequestOutput`` of `RolloutPipeline` -> `Trajectory`.

    Reads ``trajectory_latents`` (W + 1, *latent), ``trajectory_log_probs`` (W,),
    ``trajectory_timesteps`` (the W + 1 sigmas of the window), ``images`` and
    ``multimodal_output["metadata"]["diffusion_rollout"]`` (window, final latent, condition,
    timings); errors name what is missing or inconsistent.
    """
    rid = request.request_id
    err = getattr(output, "error", None)
    if err:
        raise RuntimeError(f"vllm-omni failed request {rid!r}: {err}")
    mm = getattr(output, "multimodal_output", None) or {}
    meta = (mm.get("metadata") or {}).get(EXTRA_KEY) if isinstance(mm, dict) else None
    if not meta:
        raise ValueError(
            f"output for {rid!r} has no multimodal_output['metadata'][{EXTRA_KEY!r}]: was the "
            f"engine started with custom_pipeline_args pipeline_class={PIPELINE_CLASS} and "
            f"model_class_name={MODEL_CLASS_NAME}?"
        )
    if meta.get("request_id") not in (None, rid):
        raise ValueError(f"output for {rid!r} carries request {meta['request_id']!r}")
    lat = _tensor(output.trajectory_latents, "trajectory_latents", rid)
    logp = _tensor(output.trajectory_log_probs, "trajectory_log_probs", rid).reshape(-1)
    sig = _tensor(output.trajectory_timesteps, "trajectory_timesteps", rid).reshape(-1)
    start, end = (int(v) for v in meta["window"])
    w = end - start
    if lat.shape[0] != w + 1 or logp.shape[0] != w or sig.shape[0] != w + 1:
        raise ValueError(
            f"output for {rid!r}: window {(start, end)} needs {w + 1} latents, {w} log-probs "
            f"and {w + 1} sigmas, got {tuple(lat.shape)}, {tuple(logp.shape)}, {tuple(sig.shape)}"
        )
    out_kind = request.params.output
    final = meta.get("final_latent")
    return Trajectory(
        request_id=rid,
        prompt=request.prompt,
        seed=request.seed,
        window=(start, end),
        latents=lat,
        log_probs=logp,
        sigmas=sig[:-1],
        sigmas_next=sig[1:],
        final_latent=None if out_kind == "pixel" or final is None else _tensor(final, "", rid),
        media=None if out_kind == "latent" else _media(getattr(output, "images", None)),
        condition={k: torch.as_tensor(v).clone() for k, v in (meta.get("condition") or {}).items()},
        version=int(version),
        timings={k: float(v) for k, v in (meta.get("timings") or {}).items()},
        negative_prompt=request.negative_prompt,
        params=request.params,
    )


def engine_args(
    model: str,
    *,
    lora_config: dict[str, Any] | None = None,
    denoiser_factory: str | None = None,
    denoiser_options: dict[str, Any] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """``AsyncOmni`` keyword arguments that run `RolloutPipeline`: the custom pipeline and its
    arguments, the worker extension, :data:`MODEL_CLASS_NAME`, float32, eager mode (the
    trajectories match the embedded engine's), then ``overrides`` (e.g. ``max_num_seqs``,
    ``dtype``, ``num_gpus``)."""
    pipeline_args: dict[str, Any] = {"pipeline_class": PIPELINE_CLASS}
    if denoiser_factory:
        pipeline_args["denoiser_factory"] = denoiser_factory
    if denoiser_options:
        pipeline_args["denoiser_options"] = dict(denoiser_options)
    if lora_config:
        pipeline_args["lora"] = dict(lora_config)
    args: dict[str, Any] = {
        "model": model,
        "custom_pipeline_args": pipeline_args,
        "worker_extension_cls": WORKER_EXTENSION_CLASS,
        "model_class_name": MODEL_CLASS_NAME,
        "dtype": "float32",
        "enforce_eager": True,
        "max_num_seqs": 16,
    }
    args.update(overrides)
    return args


class VllmOmniEngine:
    """`EmbeddedEngine`'s interface (``generate_many``, ``generate``, ``update_weights``,
    ``stats``, ``version``, ``close``) over vllm-omni's ``AsyncOmni``.

    Args:
        model: model folder for ``AsyncOmni`` (ignored when ``omni`` is given).
        omni: an existing ``AsyncOmni`` (or an object with its ``generate`` and
            ``collective_rpc``); tests pass one that runs the pipeline in process.
        version: the weights version the model starts with.
        lora_config: ``{"rank", "alpha", "target_modules"}``: the pipeline adds this LoRA
            adapter at load, so updates can carry LoRA tensors.
        weights_dir: where update files are written (a temp dir by default; workers on other
            nodes need it on a shared filesystem).
        version_timeout_s: how long a request pinned to a future version waits.
        sampling_params_cls: vllm-omni's ``OmniDiffusionSamplingParams`` unless given.
        **omni_kwargs: more ``AsyncOmni`` arguments (see :func:`engine_args`).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        omni: Any = None,
        version: int = 0,
        lora_config: dict[str, Any] | None = None,
        weights_dir: str | None = None,
        version_timeout_s: float = 60.0,
        sampling_params_cls: Any = None,
        **omni_kwargs: Any,
    ) -> None:
        if omni is None and not model:
            raise ValueError("VllmOmniEngine needs a model path or an omni object")
        self._version = int(version)
        self.version_timeout_s = float(version_timeout_s)
        self.weights_dir = weights_dir or tempfile.mkdtemp(prefix="diffusion-rollout-weights-")
        self._sp_cls = sampling_params_cls
        self._inflight = 0
        self._updating = False
        self._stats = {"requests": 0, "failed": 0, "aborted": 0, "version_errors": 0, "updates": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-omni-engine", daemon=True
        )
        self._thread.start()
        self._cond: asyncio.Condition = self._call(self._make_cond())
        self._update_lock: asyncio.Lock = self._call(self._make_lock())
        if omni is None:
            kwargs = engine_args(str(model), lora_config=lora_config, **omni_kwargs)
            omni = self._call(self._make_omni(kwargs))
        self.omni = omni

    # -- loop plumbing
    async def _make_cond(self) -> asyncio.Condition:
        return asyncio.Condition()

    async def _make_lock(self) -> asyncio.Lock:
        return asyncio.Lock()

    async def _make_omni(self, kwargs: dict[str, Any]) -> Any:
        return _vllm_omni("vllm_omni.entrypoints.async_omni", "AsyncOmni")(**kwargs)

    def _submit(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro) -> Any:
        return self._submit(coro).result()

    # -- public API
    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: RolloutRequest) -> Trajectory:
        return await asyncio.wrap_future(self._submit(self._generate(request)))

    async def agenerate_many(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        futs = [asyncio.wrap_future(self._submit(self._generate(r))) for r in requests]
        return list(await asyncio.gather(*futs))

    def generate_many(self, requests: Sequence[RolloutRequest], **_: Any) -> list[Trajectory]:
        futs = [self._submit(self._generate(r)) for r in requests]
        return [f.result() for f in futs]

    def update_weights(self, tensors: dict[str, Tensor], version: int) -> None:
        self._call(self._update(tensors, int(version)))

    def stats(self) -> dict[str, Any]:
        return {**self._stats, "version": self._version, "in_flight": self._inflight}

    def close(self) -> None:
        shutdown = getattr(self.omni, "shutdown", None)
        if callable(shutdown):
            self._loop.call_soon_threadsafe(shutdown)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        shutil.rmtree(self.weights_dir, ignore_errors=True)

    def __enter__(self) -> VllmOmniEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (run on the engine loop)
    async def _admit(self, request: RolloutRequest) -> int:
        """Wait while an update is loading and, for a pinned request, for its version; then
        count the request in flight and return the version it runs on."""
        want = request.params.weights_version
        if want is not None and want < self._version:
            self._stats["version_errors"] += 1
            raise VersionMismatchError(
                f"request {request.request_id!r} asks for weights version {want}, but the "
                f"engine is at version {self._version} (old weights are not kept)"
            )

        def ready() -> bool:
            return not self._updating and (want is None or self._version >= want)

        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(ready), self.version_timeout_s)
            except asyncio.TimeoutError:
                self._stats["version_errors"] += 1
                raise VersionMismatchError(
                    f"request {request.request_id!r} asks for weights version {want}; the "
                    f"engine is at version {self._version} and no update_weights brought "
                    f"version {want} within {self.version_timeout_s:g} s"
                ) from None
            if want is not None and self._version != want:
                self._stats["version_errors"] += 1
                raise VersionMismatchError(
                    f"request {request.request_id!r} asks for weights version {want}; the "
                    f"engine moved to version {self._version} first"
                )
            self._inflight += 1
            return self._version

    async def _generate(self, request: RolloutRequest) -> Trajectory:
        if not isinstance(request, RolloutRequest):
            raise TypeError(f"expected a RolloutRequest, got {type(request).__name__}")
        version = await self._admit(request)
        prompt, sp = build_omni_request(request, version=version, sampling_params_cls=self._sp_cls)
        final = None
        try:
            async for out in self.omni.generate(
                prompt, request_id=request.request_id, sampling_params_list=[sp]
            ):
                final = out
        except asyncio.CancelledError:
            self._stats["aborted"] += 1
            raise RequestAborted(f"request {request.request_id!r} was aborted") from None
        except Exception:
            self._stats["failed"] += 1
            raise
        finally:
            async with self._cond:
                self._inflight -= 1
                self._cond.notify_all()
        if final is None:
            self._stats["aborted"] += 1
            raise RequestAborted(f"vllm-omni returned no output for {request.request_id!r}")
        self._stats["requests"] += 1
        return parse_omni_output(request, final, version=version)

    async def _update(self, tensors: dict[str, Tensor], version: int) -> None:
        async with self._update_lock:
            if version <= self._version:
                raise ValueError(
                    f"update_weights: version {version} is not newer than the engine's "
                    f"version {self._version}"
                )
            async with self._cond:
                self._updating = True
                try:
                    # requests in flight finish on the old weights
                    await self._cond.wait_for(lambda: self._inflight == 0)
                    path = await asyncio.to_thread(self._write, tensors, version)
                    try:
                        results = await self.omni.collective_rpc(LOAD_METHOD, args=(path,))
                    finally:
                        os.unlink(path)
                    _check_rpc(results, LOAD_METHOD, len(tensors))
                    self._version = version
                    self._stats["updates"] += 1
                finally:
                    self._updating = False
                    self._cond.notify_all()

    def _write(self, tensors: dict[str, Tensor], version: int) -> str:
        from safetensors.torch import save_file

        path = os.path.join(self.weights_dir, f"v{version}.safetensors")
        save_file(
            {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()},
            path,
            metadata={"version": str(version)},
        )
        return path


def _flatten(results: Any) -> list[Any]:
    if isinstance(results, (list, tuple)):
        return [a for r in results for a in _flatten(r)]
    return [results]


def _check_rpc(results: Any, method: str, count: int) -> None:
    """Every worker's answer to the load RPC (one per stage replica, each maybe a list per
    worker rank) must say it loaded ``count`` tensors."""
    answers = _flatten(results)
    if not answers:
        raise RuntimeError(f"{method}: no worker answered")
    for a in answers:
        if not (isinstance(a, dict) and a.get("loaded") == count):
            raise RuntimeError(
                f"{method}: a worker answered {json.dumps(a, default=str)[:300]}, "
                f"expected {{'loaded': {count}}}"
            )
