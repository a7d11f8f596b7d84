"""Sampling parameters and rollout requests.

`SamplingParams.compat_key()` decides which requests may share one transformer forward: two
requests with equal keys have the same latent shape, the same sigma schedule and the same
guidance, so their rows can be stacked. Seeds, prompts, negative prompts, SDE noise levels,
SDE kinds and SDE window starts stay per request (per row).
"""

from __future__ import annotations

import base64
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch

__all__ = ["OUTPUTS", "SDE_KINDS", "RolloutRequest", "SamplingParams"]

OUTPUTS = ("latent", "pixel", "both")
#: condition images (PNG/JPEG/safetensors on the wire) larger than this are refused
MAX_IMAGE_PIXELS = 4096 * 4096
SDE_KINDS = ("sde", "cps", "dance", "ode")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"SamplingParams.{name} must be an integer >= 1, got {value!r}")
    return value


def _finite_float(name: str, value: Any, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"SamplingParams.{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < low:
        raise ValueError(f"SamplingParams.{name} must be a finite number >= {low}, got {value}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How one rollout sample is drawn.

    Attributes:
        height, width: image size in pixels (the denoiser maps it to its latent size).
        num_frames: 1 for images; > 1 gives video latents (B, C, F, H, W).
        num_steps: denoising steps; the schedule has ``num_steps + 1`` sigmas.
        guidance_scale: classifier-free guidance scale (> 1 packs an empty/negative branch
            into the same forward, doubling the rows the transformer sees).
        true_cfg_scale: true CFG with the request's negative prompt (> 1 enables it).
        noise_level: eta of the SDE steps (``omni_algos.sde.step``).
        sde_kind: "sde" (Flow-GRPO), "cps", "dance" or "ode" (no noise, log-prob 0).
        sde_window_size: number of SDE steps per sample; None = every step but the last.
        sde_window_range: ``(low, high)`` range the window start is drawn in; None =
            ``(0, num_steps)``.
        ode_stride_after_window: after the last SDE window step of the wave, each ODE step
            jumps this many schedule steps with DPM-Solver++(2M)
            (`omni_algos.ode.dpm_solver_2m_step`): fewer forwards for the untrained tail, as
            MixGRPO-Flash does (Li et al. 2025, arXiv 2507.21802). 1 = Euler on every step.
        output: "latent" (final latent, no decode), "pixel" (uint8 media, no final latent)
            or "both".
        weights_version: the weights (LoRA) version this request must run on; None = whatever
            the engine has when the request's wave starts.
    """

    height: int = 512
    width: int = 512
    num_frames: int = 1
    num_steps: int = 10
    guidance_scale: float = 1.0
    true_cfg_scale: float = 1.0
    noise_level: float = 0.7
    sde_kind: str = "sde"
    sde_window_size: int | None = None
    sde_window_range: tuple[int, int] | None = None
    ode_stride_after_window: int = 1
    output: str = "both"
    weights_version: int | None = None

    def __post_init__(self) -> None:
        for name in ("height", "width", "num_frames", "num_steps", "ode_stride_after_window"):
            _positive_int(name, getattr(self, name))
        for name in ("guidance_scale", "true_cfg_scale"):
            object.__setattr__(self, name, _finite_float(name, getattr(self, name)))
        object.__setattr__(self, "noise_level", _finite_float("noise_level", self.noise_level))
        if self.sde_kind not in SDE_KINDS:
            raise ValueError(
                f"SamplingParams.sde_kind must be one of {SDE_KINDS}, got {self.sde_kind!r}"
            )
        if self.output not in OUTPUTS:
            raise ValueError(f"SamplingParams.output must be one of {OUTPUTS}, got {self.output!r}")
        rng = self.sde_window_range
        if rng is not None:
            if (
                not isinstance(rng, (tuple, list))
                or len(rng) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in rng)
            ):
                raise ValueError(
                    f"SamplingParams.sde_window_range must be a pair of ints (low, high), got {rng!r}"
                )
            low, high = int(rng[0]), int(rng[1])
            if not 0 <= low < high <= self.num_steps:
                raise ValueError(
                    "SamplingParams.sde_window_range must satisfy 0 <= low < high <= num_steps "
                    f"({self.num_steps}), got {(low, high)}"
                )
            object.__setattr__(self, "sde_window_range", (low, high))
        if self.sde_window_size is not None:
            size = self.sde_window_size
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"SamplingParams.sde_window_size must be an integer >= 1 or None, got {size!r}"
                )
            low, high = self.window_range()
            if size > high - low:
                raise ValueError(
                    f"SamplingParams.sde_window_size={size} does not fit in "
                    f"sde_window_range {(low, high)}"
                )
        v = self.weights_version
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(
                f"SamplingParams.weights_version must be an integer >= 0 or None, got {v!r}"
            )

    def window_range(self) -> tuple[int, int]:
        """``(low, high)`` the SDE window start is drawn in."""
        return self.sde_window_range or (0, self.num_steps)

    def compat_key(self) -> tuple:
        """The fields two requests must share to be packed into one forward.

        Latent shape (height, width, num_frames), schedule (num_steps,
        ode_stride_after_window), guidance (guidance_scale, true_cfg_scale), output and
        weights_version (always last). SDE kind, noise level and window size/range are applied
        per row after the forward, so they are not in the key.
        """
        return (
            self.height,
            self.width,
            self.num_frames,
            self.num_steps,
            self.guidance_scale,
            self.true_cfg_scale,
            self.ode_stride_after_window,
            self.output,
            self.weights_version,
        )

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        data = self.to_dict()
        data.update(changes)
        return SamplingParams.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the window range as a list)."""
        data = asdict(self)
        if data["sde_window_range"] is not None:
            data["sde_window_range"] = list(data["sde_window_range"])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a dict; unknown keys are an error that names them."""
        if not isinstance(data, dict):
            raise ValueError(f"params must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"SamplingParams: unknown field(s) {unknown}; known: {sorted(known)}")
        data = dict(data)
        if isinstance(data.get("sde_window_range"), list):
            data["sde_window_range"] = tuple(data["sde_window_range"])
        return cls(**data)


@dataclass(frozen=True)
class RolloutRequest:
    """One sample to roll out.

    Attributes:
        prompt: the text prompt.
        seed: seeds the request's own ``torch.Generator``; every random draw of the sample
            (window start, initial latents, SDE noise) comes from it.
        params: the sampling parameters.
        request_id: the caller's id, echoed in the trajectory (unique per engine queue).
        negative_prompt: for true CFG / guidance; None encodes "".
        image: the condition image of an image-conditioned model (Qwen-Image-Edit): a uint8
            ``(H, W, 3)`` numpy array or torch tensor, any size (the denoiser resizes it); or a
            list of them, several condition images for one request (Qwen-Image-Edit-Plus).
            Required by a denoiser with ``needs_images = True``, refused by any other. Not part
            of ``==`` / ``hash`` (arrays have no truth value); requests with images still share
            a wave when their ``params.compat_key()`` and their image counts agree.
    """

    prompt: str
    seed: int
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    negative_prompt: str | None = None
    image: np.ndarray | torch.Tensor | list[np.ndarray | torch.Tensor] | None = field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise ValueError(
                f"RolloutRequest.prompt must be a string, got {type(self.prompt).__name__}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"RolloutRequest.seed must be an integer, got {self.seed!r}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"RolloutRequest.seed must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(
                f"RolloutRequest.params must be a SamplingParams, got {type(self.params).__name__}"
            )
        if not isinstance(self.request_id, str):
            raise ValueError(
                f"RolloutRequest.request_id must be a string, got {type(self.request_id).__name__}"
            )
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise ValueError(
                "RolloutRequest.negative_prompt must be a string or None, got "
                f"{type(self.negative_prompt).__name__}"
            )
        if isinstance(self.image, (list, tuple)):
            if not self.image:
                raise ValueError("RolloutRequest.image: an empty list (give None for no image)")
            for i, im in enumerate(self.image):
                _check_image(im, f"RolloutRequest.image[{i}]")
            object.__setattr__(self, "image", list(self.image))
        elif self.image is not None:
            _check_image(self.image)

    @property
    def num_images(self) -> int:
        """How many condition images the request carries (0, 1, or the list's length)."""
        if self.image is None:
            return 0
        return len(self.image) if isinstance(self.image, list) else 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the HTTP request body).

        A condition image goes as ``"image": base64(safetensors blob)`` holding one uint8
        tensor ``image`` of shape (H, W, 3) (needs ``safetensors``, the ``server`` extra), a
        list of images as a list of such strings; the key is left out when there is no image.
        """
        data: dict[str, Any] = {
            "prompt": self.prompt,
            "seed": self.seed,
            "params": self.params.to_dict(),
            "request_id": self.request_id,
            "negative_prompt": self.negative_prompt,
        }
        if isinstance(self.image, list):
            data["image"] = [image_to_base64(im) for im in self.image]
        elif self.image is not None:
            data["image"] = image_to_base64(self.image)
        return data

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], *, max_image_pixels: int = MAX_IMAGE_PIXELS
    ) -> RolloutRequest:
        """Build from a JSON dict; errors name the bad field. A PNG/JPEG condition image
        larger than ``max_image_pixels`` is refused before it is decoded."""
        if not isinstance(data, dict):
            raise ValueError(f"request body must be a JSON object, got {type(data).__name__}")
        known = {"prompt", "seed", "params", "request_id", "negative_prompt", "image"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"RolloutRequest: unknown field(s) {unknown}; known: {sorted(known)}")
        for name in ("prompt", "seed"):
            if name not in data:
                raise ValueError(f"RolloutRequest.{name} is required")
        # null means "not given"; any other non-object (0, [], "x") is an error, never the
        # defaults in disguise
        params = data.get("params")
        if params is not None and not isinstance(params, dict):
            raise ValueError(
                f"RolloutRequest.params must be an object, got {type(params).__name__}"
            )
        request_id = data.get("request_id")
        return cls(
            prompt=data["prompt"],
            seed=data["seed"],
            params=SamplingParams.from_dict(params or {}),
            request_id="" if request_id is None else request_id,
            negative_prompt=data.get("negative_prompt"),
            image=_images_from_wire(data.get("image"), max_image_pixels),
        )


def _images_from_wire(
    value: Any, max_pixels: int = MAX_IMAGE_PIXELS
) -> torch.Tensor | list[torch.Tensor] | None:
    if value is None:
        return None
    if isinstance(value, list):
        return [
            image_from_base64(v, f"RolloutRequest.image[{i}]", max_pixels=max_pixels)
            for i, v in enumerate(value)
        ]
    return image_from_base64(value, max_pixels=max_pixels)


def _check_image(image: Any, name: str = "RolloutRequest.image") -> None:
    if isinstance(image, np.ndarray):
        dtype_ok, shape = image.dtype == np.uint8, tuple(image.shape)
    elif isinstance(image, torch.Tensor):
        dtype_ok, shape = image.dtype == torch.uint8, tuple(image.shape)
    else:
        raise ValueError(
            f"{name} must be a uint8 (H, W, 3) numpy array or torch tensor, got "
            f"{type(image).__name__} (several condition images: a list of them)"
        )
    if not dtype_ok:
        raise ValueError(f"{name} must have dtype uint8, got {image.dtype}")
    if len(shape) != 3 or shape[-1] != 3 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"{name} must have shape (H, W, 3), got {shape}")


def image_to_base64(image: np.ndarray | torch.Tensor) -> str:
    """base64 text of a safetensors blob holding ``image`` (uint8 (H, W, 3)) as tensor ``image``."""
    try:
        from safetensors.torch import save
    except ImportError:  # pragma: no cover - the server extra
        raise ImportError(
            "RolloutRequest.image on the wire needs safetensors: pip install 'diffusion-rollout[server]'"
        ) from None
    _check_image(image)
    t = torch.as_tensor(np.ascontiguousarray(image)) if isinstance(image, np.ndarray) else image
    return base64.b64encode(save({"image": t.detach().to("cpu").contiguous().clone()})).decode()


def image_from_base64(
    text: Any, name: str = "RolloutRequest.image", *, max_pixels: int = MAX_IMAGE_PIXELS
) -> torch.Tensor:
    """Inverse of :func:`image_to_base64`; also takes base64 PNG/JPEG bytes (with pillow).

    A PNG/JPEG whose header declares more than ``max_pixels`` pixels is refused before it is
    decoded (a small file can declare a huge image). Errors name ``name``
    (``RolloutRequest.image``, or ``RolloutRequest.image[i]``).
    """
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a base64 string on the wire, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise ValueError(f"{name} is not valid base64: {exc}") from None
    if raw[:8] == b"\x89PNG\r\n\x1a\n" or raw[:3] == b"\xff\xd8\xff":
        try:
            import io

            from PIL import Image
        except ImportError:
            raise ValueError(
                f"{name}: PNG/JPEG needs pillow on the server (pip install pillow); "
                "or send a safetensors blob"
            ) from None
        try:
            with Image.open(io.BytesIO(raw)) as im:
                if im.width * im.height > max_pixels:
                    raise ValueError(
                        f"{name}: {im.width}x{im.height} is more than the {max_pixels} pixels "
                        "allowed"
                    )
                arr = np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
        except (OSError, SyntaxError, Image.DecompressionBombError) as exc:
            raise ValueError(f"{name}: cannot decode the image ({exc})") from None
        return torch.from_numpy(arr)
    try:
        from safetensors.torch import load
    except ImportError:  # pragma: no cover - the server extra
        raise ValueError(
            f"{name} needs safetensors: pip install 'diffusion-rollout[server]'"
        ) from None
    try:
        tensors = load(raw)
    except Exception as exc:  # safetensors raises its own error type
        raise ValueError(f"{name} is neither PNG/JPEG nor a safetensors blob ({exc})") from None
    if set(tensors) != {"image"}:
        raise ValueError(
            f"{name}: the safetensors blob must hold one tensor 'image', got {sorted(tensors)}"
        )
    img = tensors["image"]
    _check_image(img, name)
    if img.shape[0] * img.shape[1] > max_pixels:
        raise ValueError(
            f"{name}: {img.shape[1]}x{img.shape[0]} is more than the {max_pixels} pixels allowed"
        )
    return img
