"""The worker side of the vllm-omni backend: what runs inside vllm-omni's diffusion workers.

This module imports vllm-omni at the top (its ``DiffusionOutput`` and the custom-pipeline
worker extension); vllm-omni's workers import it by qualified name, never the client, so
``diffusion_rollout`` itself imports without vllm-omni. Facts it relies on, read from
vllm-omni 0.30 (the version uv.lock pins) and checked against it by tests/test_vllm_backend.py
in the lock's vllm-omni environment (``nox -s tests-vllm-omni``):

- A custom pipeline is built as ``pipeline_class(od_config=od_config)`` on the CPU, then moved
  with ``.to(device)`` (``DiffusersPipelineLoader._init_from_load_format``): it must be an
  ``nn.Module``. The loader then calls ``pipeline.load_weights(iterator)`` over the files of
  ``pipeline.weights_sources`` and requires every parameter not marked
  ``is_checkpoint_optional`` to be among the names it returns.
- The runner hands ``forward`` a ``DiffusionRequestBatch`` of several requests only when the
  class says ``supports_request_batch = True``, and requires a ``list[DiffusionOutput]``, one
  per request, in the batch's order (``_normalize_pipeline_outputs``).
- A ``DiffusionOutput`` has no ``custom_output`` field (0.30 removed it). Rollout data travels
  in the canonical envelope ``output = {"payload": {...}, "metadata": {...}}``: the payload's
  ``trajectory`` (``latents`` / ``timesteps`` / ``log_probs``) fills the client's
  ``OmniRequestOutput.trajectory_*`` fields, the media key (``image`` / ``video``) its
  ``images``, and every metadata group reaches the client as
  ``OmniRequestOutput.multimodal_output["metadata"]`` (the route verl-omni's rollouts use).
- A registered family post-process (chosen by ``od_config.model_class_name``) would treat the
  envelope as an image tensor; :data:`MODEL_CLASS_NAME` is a name vllm-omni registers nothing
  for, so the envelope reaches the client as the pipeline built it.
- vllm-omni's own LoRA manager (``add_lora``) only wraps vLLM ``LinearBase`` layers; the
  diffusers modules an omni-adapters denoiser runs have none, so an adapter added that way
  would change nothing. Weights therefore sync the way verl-omni's workers sync full weights:
  an RPC on the worker (:class:`RolloutWorkerExtension`) that calls
  ``model_runner.pipeline.load_weights``.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

from .lora import LoraSpec, ensure_lora
from .params import RolloutRequest
from .vllm_backend import EXTRA_KEY, request_from_omni
from .wave import denoise_wave

__all__ = ["RolloutPipeline", "RolloutWorkerExtension", "rollout_output"]


def _import_string(path: str) -> Any:
    """``"package.module:attr"`` or ``"package.module.attr"`` -> the object."""
    mod, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(mod), attr)


def rollout_output(traj: Any) -> DiffusionOutput:
    """One request's `Trajectory` as a ``DiffusionOutput`` envelope (tensors moved to CPU).

    ``payload.trajectory``: ``latents`` (W + 1, *latent), ``timesteps`` (the W + 1 sigmas of
    the window), ``log_probs`` (W,); ``payload.image`` (uint8 (H, W, 3)) or ``payload.video``
    (uint8 (F, H, W, 3)) when the request asked for media; ``metadata.diffusion_rollout``:
    request id, window, version, final latent, replay condition, timings."""
    payload: dict[str, Any] = {
        "trajectory": {
            "latents": traj.latents,
            "timesteps": torch.cat([traj.sigmas, traj.sigmas_next[-1:]]),
            "log_probs": traj.log_probs,
        }
    }
    if traj.media is not None:
        payload["video" if traj.media.ndim == 4 else "image"] = traj.media
    meta = {
        "request_id": traj.request_id,
        "window": [int(traj.window[0]), int(traj.window[1])],
        "version": int(traj.version),
        "final_latent": traj.final_latent,
        "condition": dict(traj.condition),
        "timings": {k: float(v) for k, v in traj.timings.items()},
    }
    return DiffusionOutput(output={"payload": payload, "metadata": {EXTRA_KEY: meta}}, to_cpu=True)


def _warmup_request(request: Any) -> bool:
    """vllm-omni's startup warmup sends a request of its own (its dummy-run id, no rollout
    data); any other request without rollout data is an error (`request_from_omni`)."""
    is_dummy = getattr(request, "is_dummy_run", None)
    extra = getattr(request.sampling_params, "extra_args", None) or {}
    return callable(is_dummy) and is_dummy() and EXTRA_KEY not in extra


class RolloutPipeline(nn.Module):
    """A vllm-omni custom pipeline running diffusion_rollout's wave loop on a `Denoiser`.

    ``custom_pipeline_args`` (set by `VllmOmniEngine`): ``pipeline_class`` = this class,
    ``denoiser_factory`` = ``"module:function"`` called as ``factory(od_config.model,
    dtype=od_config.dtype, **denoiser_options)`` (default ``"omni_adapters:from_pretrained"``,
    imported by name so this package keeps no import of omni_adapters), ``denoiser_options``,
    and ``lora`` = ``{"rank", "alpha", "target_modules"}`` to add a LoRA adapter at load
    (``denoiser.add_lora``) that weight syncs then fill.

    ``forward(batch)`` groups the batch's requests by compatibility key and weights version,
    runs one wave per group (every request drawing from its own seeded generator, so its
    trajectory is the one it would have alone) and returns one ``DiffusionOutput`` per request,
    in the batch's order (:func:`rollout_output`). vllm-omni's startup warmup request (it
    carries no rollout data) gets an empty output.
    """

    supports_request_batch = True

    def __init__(self, *, od_config: Any = None, prefix: str = "", denoiser: Any = None) -> None:
        super().__init__()
        args = dict(getattr(od_config, "custom_pipeline_args", None) or {})
        if denoiser is None:
            factory = _import_string(args.get("denoiser_factory", "omni_adapters:from_pretrained"))
            options = dict(args.get("denoiser_options") or {})
            options.setdefault("dtype", getattr(od_config, "dtype", torch.float32))
            denoiser = factory(od_config.model, **options)
        if args.get("lora"):
            ensure_lora(denoiser, LoraSpec.from_dict(args["lora"]))
        self.od_config = od_config
        self.prefix = prefix
        #: nothing for vllm-omni's loader to read from disk: the factory loaded the weights
        self.weights_sources: list[Any] = []
        # An nn.Module denoiser registers itself; an omni-adapters one (not a module) has its
        # modules registered here, so `.to`, `parameters()` and vllm-omni's discovery see them.
        self.denoiser = denoiser
        if not isinstance(denoiser, nn.Module):
            for name, component in getattr(denoiser, "components", {}).items():
                if isinstance(component, nn.Module):
                    self.add_module(name, component)
        # Loaded by the factory: vllm-omni's loader must not require them from its sources.
        for p in self.parameters():
            p.is_checkpoint_optional = True

    def to(self, *args: Any, **kwargs: Any) -> RolloutPipeline:
        """``nn.Module.to``, and the denoiser follows (it creates its latents on its device)."""
        super().to(*args, **kwargs)
        first = next(self.parameters(), None)
        follows = not isinstance(self.denoiser, nn.Module) and hasattr(self.denoiser, "to")
        if first is not None and follows:
            self.denoiser.to(first.device)
        return self

    def load_weights(
        self, weights: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor]
    ) -> set[str]:
        """vllm's loader interface: ``(name, tensor)`` pairs -> ``denoiser.load_weights``;
        returns the names loaded. Names are the denoiser's (omni-adapters' rollout export,
        either format); an unknown name is an error that names it."""
        items = dict(weights.items() if isinstance(weights, Mapping) else weights)
        if items:
            self.denoiser.load_weights(items)
        return set(items)

    def forward(self, batch: Any) -> list[DiffusionOutput]:
        items = list(getattr(batch, "requests", None) or [batch])
        outputs: list[DiffusionOutput | None] = [None] * len(items)
        groups: dict[tuple, list[tuple[int, RolloutRequest]]] = defaultdict(list)
        for i, item in enumerate(items):
            if _warmup_request(item):
                outputs[i] = DiffusionOutput()
                continue
            request, version = request_from_omni(item.sampling_params)
            groups[(request.params.compat_key()[:-1], version)].append((i, request))
        with torch.no_grad():
            for (_, version), members in groups.items():
                trajs, _, _ = denoise_wave(self.denoiser, [r for _, r in members], version=version)
                for (i, _), traj in zip(members, trajs):
                    outputs[i] = rollout_output(traj)
        return [o if o is not None else DiffusionOutput() for o in outputs]


class RolloutWorkerExtension(CustomPipelineWorkerExtension):
    """Worker extension (``worker_extension_cls``): vllm-omni's custom-pipeline extension
    (``re_init_pipeline`` builds :class:`RolloutPipeline`) plus the weight-sync RPC."""

    def load_rollout_weights(self, path: str) -> dict[str, Any]:
        """Load a safetensors file into this worker's pipeline (``pipeline.load_weights``);
        called through ``AsyncOmni.collective_rpc``. Returns ``{"loaded": count}``."""
        from safetensors.torch import load_file

        pipeline = getattr(getattr(self, "model_runner", None), "pipeline", None)
        if pipeline is None or not hasattr(pipeline, "load_weights"):
            raise RuntimeError("load_rollout_weights: this worker has no pipeline loaded")
        loaded = pipeline.load_weights(load_file(path))
        return {"loaded": len(loaded)}
