"""`VllmOmniEngine`: the engine interface over vllm-omni's ``AsyncOmni`` (extra ``vllm-omni``).

vllm-omni does the request-level batching on the GPU; this module adapts it to our
request / trajectory contract:

- one ``AsyncOmni.generate(prompt, request_id=..., sampling_params_list=[sp])`` call per
  sample, with the integer ``seed`` on ``OmniDiffusionSamplingParams`` and the RL knobs (the
  whole `RolloutRequest` as JSON plus the weights version) in
  ``sp.extra_args["diffusion_rollout"]`` (:func:`build_omni_request`);
- :class:`RolloutPipeline`, a custom pipeline class for vllm-omni
  (``custom_pipeline_args={"pipeline_class": "diffusion_rollout.vllm_backend.RolloutPipeline"}``)
  that runs the same wave loop as `EmbeddedEngine` (:func:`diffusion_rollout.wave.denoise_wave`)
  on a `Denoiser` and returns each request's window latents, log-probs, sigmas (as
  ``trajectory_latents`` / ``trajectory_log_probs`` / ``trajectory_timesteps``) and the rest
  in ``custom_output["diffusion_rollout"][request_id]``;
- :func:`parse_omni_output` turns the ``OmniRequestOutput`` back into a `Trajectory`;
- LoRA weights: each ``update_weights(tensors, version)`` writes a PEFT-format adapter folder
  and does one atomic add+remove: ``add_lora`` of the new version, switch new requests to it,
  wait for requests in flight on the old version to finish, ``remove_lora`` of the old id.
  The ``LoRARequest`` is cached per version (``lora_int_id = version + 1``; version 0 is the
  base weights).

vllm-omni is imported lazily (``importlib``), only when an `AsyncOmni` has to be built, so this
module imports without it; the request building and output parsing are unit-tested here
against vllm-omni's documented structures, the real GPU run is a ``gpu``-marked test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import os
import tempfile
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .params import RolloutRequest
from .types import RequestAborted, Trajectory, VersionMismatchError

__all__ = [
    "EXTRA_KEY",
    "PIPELINE_CLASS",
    "RolloutPipeline",
    "VllmOmniEngine",
    "build_omni_request",
    "parse_omni_output",
]

EXTRA_KEY = "diffusion_rollout"
PIPELINE_CLASS = "diffusion_rollout.vllm_backend.RolloutPipeline"


def _import_string(path: str) -> Any:
    """``"package.module:attr"`` or ``"package.module.attr"`` -> the object."""
    mod, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(mod), attr)


def _vllm_omni(name: str) -> Any:
    try:
        return _import_string(name)
    except ImportError as exc:
        raise ImportError(
            f"VllmOmniEngine needs vllm-omni (pip install 'diffusion-rollout[vllm-omni]'): {exc}"
        ) from None


def _construct(cls: Any, values: dict[str, Any]) -> Any:
    """``cls(**values)`` keeping only the fields a dataclass ``cls`` has (vllm-omni adds and
    renames fields between releases); the required ones must be there."""
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in values.items() if k in names}
    return cls(**values)


def build_omni_request(
    request: RolloutRequest,
    *,
    version: int,
    lora_request: Any = None,
    sampling_params_cls: Any = None,
) -> tuple[dict[str, Any], Any]:
    """The ``(prompt, OmniDiffusionSamplingParams)`` pair for one sample.

    ``prompt`` is an ``OmniTextPrompt``-shaped dict (``prompt``, ``negative_prompt``). The
    sampling params carry height, width, num_frames, num_inference_steps, guidance_scale,
    true_cfg_scale, the integer ``seed``, ``lora_request``, ``return_trajectory_latents=True``
    and ``extra_args["diffusion_rollout"] = {"request": request.to_dict(), "version": version}``.
    """
    if sampling_params_cls is None:
        sampling_params_cls = _vllm_omni("vllm_omni.inputs.data:OmniDiffusionSamplingParams")
    p = request.params
    prompt: dict[str, Any] = {"prompt": request.prompt}
    if request.negative_prompt is not None:
        prompt["negative_prompt"] = request.negative_prompt
    values = {
        "height": p.height,
        "width": p.width,
        "num_frames": p.num_frames,
        "num_inference_steps": p.num_steps,
        "guidance_scale": p.guidance_scale,
        "guidance_scale_provided": True,
        "true_cfg_scale": p.true_cfg_scale if p.true_cfg_scale > 1 else None,
        "do_classifier_free_guidance": p.guidance_scale > 1 or p.true_cfg_scale > 1,
        "seed": request.seed,
        "num_outputs_per_prompt": 1,
        "lora_request": lora_request,
        "return_trajectory_latents": True,
        "extra_args": {EXTRA_KEY: {"request": request.to_dict(), "version": int(version)}},
    }
    return prompt, _construct(sampling_params_cls, values)


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


def _media_tensor(images: Any) -> Tensor | None:
    """PIL images / arrays / tensors -> one uint8 channels-last tensor (first image)."""
    if images is None or (isinstance(images, (list, tuple)) and not images):
        return None
    first = images[0] if isinstance(images, (list, tuple)) else images
    if isinstance(first, Tensor):
        return first.to(torch.uint8)
    arr = np.asarray(first)
    if arr.dtype != np.uint8:
        arr = np.clip(np.rint(arr * 255.0 if arr.max() <= 1.0 else arr), 0, 255).astype(np.uint8)
    if arr.ndim == 2:
        arr = np.repeat(arr[..., None], 3, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(arr[..., :3]))


def _drop_batch(t: Tensor | None, ndim_without: int | None = None) -> Tensor | None:
    if t is None:
        return None
    t = torch.as_tensor(t)
    if ndim_without is not None and t.ndim == ndim_without + 1 and t.shape[0] == 1:
        return t[0]
    return t


def parse_omni_output(request: RolloutRequest, output: Any, *, version: int) -> Trajectory:
    """An ``OmniRequestOutput`` of :class:`RolloutPipeline` -> `Trajectory`.

    Reads ``output.custom_output["diffusion_rollout"][request_id]`` (window, sigmas_next,
    condition, media, final_latent), and the window tensors from
    ``trajectory_latents`` (W+1, *latent) / ``trajectory_log_probs`` (W,) /
    ``trajectory_timesteps`` (the W+1 sigmas of the window), with or without a leading
    batch dim of 1; errors name what is missing or inconsistent.
    """
    err = getattr(output, "error", None)
    if err:
        raise RuntimeError(f"vllm-omni failed request {request.request_id!r}: {err}")
    custom = getattr(output, "custom_output", None) or {}
    per_req = custom.get(EXTRA_KEY) or {}
    if request.request_id in per_req:
        extra = per_req[request.request_id]
    elif len(per_req) == 1:
        extra = next(iter(per_req.values()))
    else:
        raise ValueError(
            f"output for {request.request_id!r} has no custom_output[{EXTRA_KEY!r}] entry; "
            f"was the engine started with custom_pipeline_args pipeline_class={PIPELINE_CLASS}?"
        )
    lat = extra.get("latents", getattr(output, "trajectory_latents", None))
    logp = extra.get("log_probs", getattr(output, "trajectory_log_probs", None))
    sig = extra.get("sigmas", getattr(output, "trajectory_timesteps", None))
    for name, value in (
        ("trajectory_latents", lat),
        ("trajectory_log_probs", logp),
        ("trajectory_timesteps", sig),
    ):
        if value is None:
            raise ValueError(f"output for {request.request_id!r} has no {name}")
    start, end = (int(v) for v in extra["window"])
    w = end - start
    logp = torch.as_tensor(logp, dtype=torch.float32).reshape(-1)
    sig = torch.as_tensor(sig, dtype=torch.float32).reshape(-1)
    lat = torch.as_tensor(lat)
    if lat.ndim >= 2 and lat.shape[0] == 1 and lat.shape[1] == w + 1:
        lat = lat[0]
    if lat.shape[0] != w + 1 or logp.shape[0] != w:
        raise ValueError(
            f"output for {request.request_id!r}: window {(start, end)} needs {w + 1} latents and "
            f"{w} log-probs, got {tuple(lat.shape)} and {tuple(logp.shape)}"
        )
    if sig.shape[0] == w + 1:
        sigmas, sigmas_next = sig[:-1], sig[1:]
    elif sig.shape[0] == w and "sigmas_next" in extra:
        sigmas, sigmas_next = sig, torch.as_tensor(extra["sigmas_next"], dtype=torch.float32)
    else:
        raise ValueError(
            f"output for {request.request_id!r}: trajectory_timesteps has {sig.shape[0]} sigmas, "
            f"expected {w + 1} (the window's sigmas and its last sigma_next)"
        )
    media = extra.get("media")
    if media is None and request.params.output != "latent":
        media = _media_tensor(getattr(output, "images", None))
    final = extra.get("final_latent")
    if final is None and request.params.output != "pixel":
        final = _drop_batch(getattr(output, "latents", None), lat.ndim - 1)
    return Trajectory(
        request_id=request.request_id,
        prompt=request.prompt,
        seed=request.seed,
        window=(start, end),
        latents=lat.to(torch.float32),
        log_probs=logp,
        sigmas=sigmas,
        sigmas_next=sigmas_next,
        final_latent=None if request.params.output == "pixel" else final,
        media=None if request.params.output == "latent" else media,
        condition=dict(extra.get("condition") or {}),
        version=int(version),
        timings={k: float(v) for k, v in (extra.get("timings") or {}).items()},
        negative_prompt=request.negative_prompt,
        params=request.params,
    )


def _stack_or_list(media: list[Tensor | None]) -> Tensor | list | None:
    if any(m is None for m in media):
        return None
    if all(m.shape == media[0].shape for m in media):
        return torch.stack(media)
    return media


@dataclasses.dataclass
class _PipelineOutput:
    """Stand-in for ``vllm_omni.diffusion.data.DiffusionOutput`` when it is not installed."""

    output: Any = None
    trajectory_latents: Any = None
    trajectory_timesteps: Any = None
    trajectory_log_probs: Any = None
    custom_output: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None


class RolloutPipeline:
    """A vllm-omni custom pipeline that runs diffusion_rollout's wave loop on a `Denoiser`.

    ``custom_pipeline_args``: ``pipeline_class`` = :data:`PIPELINE_CLASS`,
    ``denoiser_factory`` = ``"module:function"`` called as ``factory(od_config.model,
    **denoiser_options)`` (default ``"omni_adapters:from_pretrained"``, imported by name so
    this package keeps no import of omni_adapters), ``denoiser_options`` = dict.

    ``forward(batch)`` takes a ``DiffusionRequestBatch`` (``.requests``, each with
    ``.sampling_params`` built by :func:`build_omni_request`) or a single request, groups
    compatible requests into waves and returns a ``DiffusionOutput`` whose
    ``custom_output["diffusion_rollout"]`` maps each request id to its trajectory pieces;
    with one request the ``trajectory_*`` fields hold its window tensors too.
    """

    def __init__(self, *, od_config: Any = None, prefix: str = "", denoiser: Any = None) -> None:
        if denoiser is None:
            args = dict(getattr(od_config, "custom_pipeline_args", None) or {})
            factory = _import_string(args.get("denoiser_factory", "omni_adapters:from_pretrained"))
            denoiser = factory(od_config.model, **dict(args.get("denoiser_options") or {}))
        self.denoiser = denoiser
        self.od_config = od_config
        self.prefix = prefix
        # vllm-omni's LoRA manager looks for the pipeline's transformer.
        self.transformer = getattr(denoiser, "transformer", None)

    def load_weights(self, tensors: dict[str, Tensor]) -> None:
        self.denoiser.load_weights(tensors)

    def forward(self, req: Any) -> Any:
        from .wave import denoise_wave

        items = list(getattr(req, "requests", None) or [req])
        parsed = [request_from_omni(item.sampling_params) for item in items]
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, (r, v) in enumerate(parsed):
            groups[(r.params.compat_key()[:-1], v)].append(i)
        results: dict[str, dict[str, Any]] = {}
        with torch.no_grad():
            for (_, version), idx in groups.items():
                trajs, _, _ = denoise_wave(
                    self.denoiser, [parsed[i][0] for i in idx], version=version
                )
                for t in trajs:
                    results[t.request_id] = {
                        "window": list(t.window),
                        "latents": t.latents,
                        "log_probs": t.log_probs,
                        "sigmas": torch.cat([t.sigmas, t.sigmas_next[-1:]]),
                        "sigmas_next": t.sigmas_next,
                        "final_latent": t.final_latent,
                        "media": t.media,
                        "condition": t.condition,
                        "timings": t.timings,
                    }
        try:
            out_cls = _import_string("vllm_omni.diffusion.data:DiffusionOutput")
        except ImportError:
            out_cls = _PipelineOutput
        order = [parsed[i][0].request_id for i in range(len(items))]
        media = [results[r]["media"] for r in order]
        values: dict[str, Any] = {
            "output": _stack_or_list(media),
            "custom_output": {EXTRA_KEY: results},
        }
        if len(order) == 1:
            one = results[order[0]]
            values.update(
                trajectory_latents=one["latents"],
                trajectory_timesteps=one["sigmas"],
                trajectory_log_probs=one["log_probs"],
            )
        return _construct(out_cls, values)

    __call__ = forward


def _write_lora_dir(
    tensors: dict[str, Tensor], version: int, root: str, config: dict[str, Any]
) -> str:
    """A PEFT-format adapter folder (adapter_model.safetensors + adapter_config.json)."""
    from safetensors.torch import save_file

    path = os.path.join(root, f"v{version}")
    os.makedirs(path, exist_ok=True)
    save_file(
        {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()},
        os.path.join(path, "adapter_model.safetensors"),
    )
    cfg = {"peft_type": "LORA", "task_type": None, "bias": "none", **config}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path


class VllmOmniEngine:
    """`EmbeddedEngine`'s interface over vllm-omni's ``AsyncOmni``.

    Args:
        model: model path for ``AsyncOmni(model=...)`` (ignored when ``omni`` is given).
        omni: an existing ``AsyncOmni``-like object (``generate`` async generator,
            ``add_lora``, ``remove_lora``); tests pass a fake.
        version: the weights version the model starts with (0 = base weights, no LoRA).
        lora_config: PEFT ``adapter_config.json`` fields for pushed LoRA weights (``r``,
            ``lora_alpha``, ``target_modules``, ...).
        lora_dir: where adapter folders are written (a temp dir by default).
        version_timeout_s: how long a request pinned to a future version waits.
        sampling_params_cls, lora_request_cls: override vllm-omni's classes (tests).
        **omni_kwargs: passed to ``AsyncOmni`` (``custom_pipeline_args`` defaults to
            ``{"pipeline_class": PIPELINE_CLASS}``).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        omni: Any = None,
        version: int = 0,
        lora_config: dict[str, Any] | None = None,
        lora_dir: str | None = None,
        version_timeout_s: float = 60.0,
        sampling_params_cls: Any = None,
        lora_request_cls: Any = None,
        **omni_kwargs: Any,
    ) -> None:
        if omni is None and not model:
            raise ValueError("VllmOmniEngine needs a model path or an omni object")
        self._version = int(version)
        self.version_timeout_s = float(version_timeout_s)
        self.lora_config = dict(lora_config or {"r": 8, "lora_alpha": 8, "target_modules": []})
        self.lora_dir = lora_dir or tempfile.mkdtemp(prefix="diffusion-rollout-lora-")
        self._sp_cls = sampling_params_cls
        self._lora_cls = lora_request_cls
        self._loras: dict[int, Any] = {}
        self._inflight: dict[int, int] = defaultdict(int)
        self._stats = {"requests": 0, "failed": 0, "aborted": 0, "version_errors": 0, "updates": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-omni-engine", daemon=True
        )
        self._thread.start()
        self._cond: asyncio.Condition = self._call(self._make_cond())
        self._update_lock: asyncio.Lock = self._call(self._make_lock())
        if omni is None:
            omni_kwargs.setdefault("custom_pipeline_args", {"pipeline_class": PIPELINE_CLASS})
            omni = self._call(self._make_omni(model, omni_kwargs))
        self.omni = omni

    # -- loop plumbing
    async def _make_cond(self) -> asyncio.Condition:
        return asyncio.Condition()

    async def _make_lock(self) -> asyncio.Lock:
        return asyncio.Lock()

    async def _make_omni(self, model: str, kwargs: dict[str, Any]) -> Any:
        cls = _vllm_omni("vllm_omni.entrypoints.async_omni:AsyncOmni")
        return cls(model=model, **kwargs)

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
        return {
            **self._stats,
            "version": self._version,
            "in_flight": dict(self._inflight),
            "lora_versions": sorted(self._loras),
        }

    def close(self) -> None:
        shutdown = getattr(self.omni, "shutdown", None)
        if callable(shutdown):
            self._loop.call_soon_threadsafe(shutdown)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> VllmOmniEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (run on the engine loop)
    async def _wait_version(self, request: RolloutRequest) -> None:
        want = request.params.weights_version
        if want is None or want == self._version:
            return
        if want < self._version:
            self._stats["version_errors"] += 1
            raise VersionMismatchError(
                f"request {request.request_id!r} asks for weights version {want}, but the "
                f"engine is at version {self._version} (old weights are not kept)"
            )
        async with self._cond:
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: self._version >= want), self.version_timeout_s
                )
            except asyncio.TimeoutError:
                self._stats["version_errors"] += 1
                raise VersionMismatchError(
                    f"request {request.request_id!r} asks for weights version {want}; the "
                    f"engine is at version {self._version} and no update_weights brought "
                    f"version {want} within {self.version_timeout_s:g} s"
                ) from None
        if self._version != want:
            self._stats["version_errors"] += 1
            raise VersionMismatchError(
                f"request {request.request_id!r} asks for weights version {want}; the engine "
                f"moved to version {self._version} first"
            )

    async def _generate(self, request: RolloutRequest) -> Trajectory:
        if not isinstance(request, RolloutRequest):
            raise TypeError(f"expected a RolloutRequest, got {type(request).__name__}")
        await self._wait_version(request)
        version = self._version
        prompt, sp = build_omni_request(
            request,
            version=version,
            lora_request=self._loras.get(version),
            sampling_params_cls=self._sp_cls,
        )
        self._inflight[version] += 1
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
            self._inflight[version] -= 1
            async with self._cond:
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
            lora_cls = self._lora_cls or _vllm_omni("vllm.lora.request:LoRARequest")
            path = await asyncio.to_thread(
                _write_lora_dir, tensors, version, self.lora_dir, self.lora_config
            )
            new = lora_cls(lora_name=f"rollout-v{version}", lora_int_id=version + 1, lora_path=path)
            if not await self.omni.add_lora(new):
                raise RuntimeError(f"vllm-omni refused LoRA version {version} ({path})")
            old_version = self._version
            self._loras[version] = new
            async with self._cond:
                self._version = version
                self._cond.notify_all()
                # the old version's requests in flight finish on the old adapter
                await self._cond.wait_for(lambda: self._inflight[old_version] == 0)
            old = self._loras.pop(old_version, None)
            if old is not None:
                await self.omni.remove_lora(old.lora_int_id)
            self._stats["updates"] += 1
