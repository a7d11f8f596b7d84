"""Wire format: trajectories and weights as safetensors bytes with JSON metadata. No pickle.

A trajectory is one safetensors blob: the tensors ``latents``, ``log_probs``, ``sigmas``,
``sigmas_next``, optionally ``final_latent`` and ``media``, and ``condition.<key>`` for each
condition tensor; the scalar fields go as JSON in the metadata entry ``trajectory``.
Weights are one safetensors blob of name -> tensor; the metadata holds ``version``.

Needs the ``server`` extra (safetensors).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from .params import SamplingParams
from .types import Trajectory

__all__ = [
    "read_metadata",
    "tensors_from_bytes",
    "tensors_to_bytes",
    "trajectory_from_bytes",
    "trajectory_to_bytes",
    "weights_checksum",
]

_COND = "condition."
_MAX_HEADER = 100 * 1024 * 1024


def _cpu(t: Tensor) -> Tensor:
    return t.detach().to("cpu").contiguous()


def tensors_to_bytes(tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """safetensors bytes of ``tensors`` (moved to CPU, contiguous, unshared)."""
    return st_save({k: _cpu(v).clone() for k, v in tensors.items()}, metadata=metadata)


def read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` dict of a safetensors blob (raises ValueError if malformed)."""
    if len(data) < 8:
        raise ValueError("not a safetensors blob: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(len(data) - 8, _MAX_HEADER):
        raise ValueError("not a safetensors blob: header length exceeds the data")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a safetensors blob: bad header ({exc})") from None
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("safetensors __metadata__ must be an object")
    return meta


def tensors_from_bytes(data: bytes) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tensors, metadata) from safetensors bytes; ValueError if malformed."""
    meta = read_metadata(data)
    try:
        tensors = st_load(bytes(data))
    except Exception as exc:  # safetensors raises its own error type
        raise ValueError(f"not a valid safetensors blob: {exc}") from None
    return tensors, meta


def trajectory_to_bytes(traj: Trajectory) -> bytes:
    """One trajectory as safetensors bytes (tensors on CPU)."""
    tensors: dict[str, Tensor] = {
        "latents": traj.latents,
        "log_probs": traj.log_probs,
        "sigmas": traj.sigmas,
        "sigmas_next": traj.sigmas_next,
    }
    if traj.final_latent is not None:
        tensors["final_latent"] = traj.final_latent
    if traj.media is not None:
        tensors["media"] = traj.media
    for k, v in traj.condition.items():
        tensors[_COND + k] = v
    meta = {
        "request_id": traj.request_id,
        "prompt": traj.prompt,
        "seed": traj.seed,
        "window": list(traj.window),
        "version": traj.version,
        "timings": traj.timings,
        "negative_prompt": traj.negative_prompt,
        "params": None if traj.params is None else traj.params.to_dict(),
    }
    return tensors_to_bytes(tensors, {"trajectory": json.dumps(meta)})


def trajectory_from_bytes(data: bytes, device: str | torch.device | None = None) -> Trajectory:
    """Inverse of :func:`trajectory_to_bytes`."""
    tensors, meta = tensors_from_bytes(data)
    if "trajectory" not in meta:
        raise ValueError("safetensors blob has no 'trajectory' metadata")
    m: dict[str, Any] = json.loads(meta["trajectory"])
    if device is not None:
        tensors = {k: v.to(device) for k, v in tensors.items()}
    params = m.get("params")
    return Trajectory(
        request_id=m["request_id"],
        prompt=m["prompt"],
        seed=int(m["seed"]),
        window=(int(m["window"][0]), int(m["window"][1])),
        latents=tensors["latents"],
        log_probs=tensors["log_probs"],
        sigmas=tensors["sigmas"],
        sigmas_next=tensors["sigmas_next"],
        final_latent=tensors.get("final_latent"),
        media=tensors.get("media"),
        condition={k[len(_COND) :]: v for k, v in tensors.items() if k.startswith(_COND)},
        version=int(m["version"]),
        timings={k: float(v) for k, v in (m.get("timings") or {}).items()},
        negative_prompt=m.get("negative_prompt"),
        params=None if params is None else SamplingParams.from_dict(params),
    )


def _tensor_bytes(t: Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def weights_checksum(tensors: dict[str, Tensor]) -> str:
    """sha256 over the sorted names and each tensor's dtype, shape and raw bytes.

    The same definition as docs/interfaces.md's ``weights_checksum`` (name, NUL, dtype
    without the ``torch.`` prefix, JSON shape, bytes), so both ends of a sync agree.
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        h.update(b"\0")
        h.update(str(t.dtype).removeprefix("torch.").encode())
        h.update(json.dumps(list(t.shape)).encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()
