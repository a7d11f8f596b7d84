"""`DiffusionAdapter`: the shared half of every flow-matching diffusion family.

It satisfies diffusion-rollout's ``Denoiser`` protocol structurally (no import):
``encode``, ``init_latents``, ``sigmas``, ``velocity``, ``decode``, ``load_weights``.
A family implements four hooks: :meth:`encode_prompts` (one branch of text conditioning),
:meth:`latent_shape`, :meth:`transformer_forward` (one packed forward, returns the velocity)
and, where the default image VAE path does not fit, :meth:`decode`.

Conventions (docs/interfaces.md): ``x_sigma = (1 - sigma) x0 + sigma eps`` and
``v = eps - x0``; latents are float32; ``sigma`` passed to :meth:`velocity` has shape (B,).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from .base import OmniModelBase

__all__ = [
    "NEGATIVE_PREFIX",
    "DiffusionAdapter",
    "latent_channel_stats",
    "split_condition",
    "to_uint8",
]

NEGATIVE_PREFIX = "negative_"


def split_condition(condition: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(positive, negative) branches of a condition dict.

    ``negative_<k>`` holds the negative branch of ``<k>``; a key with no negative twin (e.g.
    image-edit condition latents) is shared by both branches."""
    pos = {k: v for k, v in condition.items() if not k.startswith(NEGATIVE_PREFIX)}
    neg = {k: condition.get(NEGATIVE_PREFIX + k, v) for k, v in pos.items()}
    return pos, neg


class DiffusionAdapter(OmniModelBase):
    """Base of the flow-matching diffusion adapters (SD3, Qwen-Image, Wan, LTX-2, ...)."""

    #: "image", "video" or "video+audio"
    modality: ClassVar[str] = "image"
    #: the SamplingParams attribute whose value > 1 turns classifier-free guidance on
    cfg_param: ClassVar[str] = "guidance_scale"
    #: fixed text length every prompt is padded/truncated to (rows must stack)
    max_sequence_length: ClassVar[int] = 32
    #: static shift used when there is no scheduler component
    shift: ClassVar[float] = 1.0
    #: FSDP2 mixed precision: bf16 compute, but the velocity comes out in float32, where the
    #: SDE step's log-probs and the losses are computed
    mixed_precision: ClassVar[dict[str, str | None]] = {
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "output_dtype": "float32",
    }

    # ------------------------------------------------------------ family hooks
    def encode_prompts(self, prompts: list[str], **inputs: Any) -> dict[str, Tensor]:
        """Text conditioning for one branch: batch-first tensors of fixed per-row shape."""
        raise NotImplementedError

    def latent_shape(self, params: Any) -> tuple[int, ...]:
        """Per-row latent shape for ``params`` (height, width, num_frames)."""
        raise NotImplementedError

    def transformer_forward(
        self, latents: Tensor, sigma: Tensor, condition: dict[str, Tensor], params: Any
    ) -> Tensor:
        """One forward of the denoiser on an already packed batch; returns the velocity
        ``eps - x0`` with the latents' shape (any dtype; :meth:`velocity` casts to float32)."""
        raise NotImplementedError

    def shift_mu(self, params: Any) -> float | None:
        """``mu`` for resolution-dependent (dynamic) shifting; None for a static shift."""
        return None

    def schedule_sigmas(self, params: Any) -> list[float] | None:
        """Custom unshifted sigmas handed to the scheduler (None: the scheduler's default)."""
        return None

    # -------------------------------------------------------------- Denoiser
    def encode_shared(self, **inputs: Any) -> dict[str, Tensor]:
        """Condition entries shared by both CFG branches (e.g. image-edit condition latents);
        none by default. ``inputs`` are the extra keyword arguments of :meth:`encode`."""
        if inputs:
            raise TypeError(f"encode: unexpected inputs {sorted(inputs)} for {type(self).__name__}")
        return {}

    @torch.no_grad()
    def encode(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None = None,
        *,
        params: Any = None,
        **inputs: Any,
    ) -> dict[str, Tensor]:
        """Positive and negative text conditioning; negatives default to ``""``.

        Keys ``k`` (positive), ``negative_k`` and shared keys from :meth:`encode_shared`; every
        tensor is batch-first. Families that need more than text (image edit) take it as
        keyword ``inputs`` (``images=``). Given the sampling ``params`` of the rows and
        guidance off (:meth:`cfg_scale` <= 1), the negative branch is not encoded (no
        ``negative_*`` keys): :meth:`velocity` reads it only with guidance on."""
        if isinstance(prompts, str):
            raise TypeError("prompts: expected a list of strings, got a str")
        prompts = list(prompts)
        if negative_prompts is None:
            negative_prompts = [""] * len(prompts)
        negative_prompts = list(negative_prompts)
        if len(negative_prompts) != len(prompts):
            raise ValueError(
                f"negative_prompts: {len(negative_prompts)} given for {len(prompts)} prompts"
            )
        shared = self.encode_shared(**inputs)
        out = dict(self.encode_prompts(prompts, **inputs))
        if params is None or self.cfg_scale(params) > 1.0:
            neg = self.encode_prompts(negative_prompts, **inputs)
            out.update({NEGATIVE_PREFIX + k: v for k, v in neg.items()})
        out.update(shared)
        return out

    def init_latents(self, batch: int, params: Any, generators: list[torch.Generator]) -> Tensor:
        """Row ``b`` is ``torch.randn(row_shape, generator=generators[b])`` (CPU draw, float32),
        so a row never depends on the others in the batch."""
        if len(generators) != batch:
            raise ValueError(f"generators: {len(generators)} given for batch {batch}")
        shape = self.latent_shape(params)
        rows = [torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]
        return torch.stack(rows).to(self.device)

    def sigmas(self, params: Any) -> Tensor:
        """``(num_steps + 1,)`` float32 sigmas from ~1 down to 0, with the family's shift.

        With a flow-matching scheduler component this is exactly the pipeline's schedule
        (``scheduler.set_timesteps(num_steps, sigmas=..., mu=...)``, static shift
        ``s' = shift s / (1 + (shift - 1) s)`` or dynamic ``exp(mu) / (exp(mu) + 1/s - 1)``),
        plus the terminal 0."""
        n = int(params.num_steps)
        if n < 1:
            raise ValueError(f"num_steps: must be >= 1, got {n}")
        sched = self.components.get("scheduler")
        if sched is None:
            s = torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64)
            s = self.shift * s / (1 + (self.shift - 1) * s)
            return s.to(torch.float32)
        fresh = type(sched).from_config(sched.config)
        custom = self.schedule_sigmas(params)
        kwargs: dict[str, Any] = {"mu": self.shift_mu(params)}
        if custom is not None:
            kwargs["sigmas"] = custom
        else:
            kwargs["num_inference_steps"] = n
        fresh.set_timesteps(**kwargs)
        out = fresh.sigmas.to(dtype=torch.float32, device="cpu").clone()
        if out.shape != (n + 1,):
            raise ValueError(f"scheduler returned {tuple(out.shape)} sigmas for {n} steps")
        return out

    def cfg_scale(self, params: Any) -> float:
        """The guidance scale in effect (``cfg_param`` of params; 1.0 means no guidance)."""
        return float(getattr(params, self.cfg_param, 1.0) or 1.0)

    def combine_cfg(self, pos: Tensor, neg: Tensor, scale: float) -> Tensor:
        """Classifier-free guidance (Ho & Salimans 2022): ``v = v_neg + s (v_pos - v_neg)``."""
        return neg + scale * (pos - neg)

    def velocity(
        self, latents: Tensor, sigma: Tensor, condition: dict[str, Tensor], params: Any
    ) -> Tensor:
        """Velocity ``eps - x0`` (float32, latents' shape) with CFG inside: with a scale > 1 the
        negative and positive branches are packed into one forward ``[neg; pos]``.

        Differentiable: the trainer calls this with grad enabled for the replay."""
        if latents.dim() < 2:
            raise ValueError(f"latents: expected (B, ...), got {tuple(latents.shape)}")
        b = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
        if sigma.dim() == 0:
            sigma = sigma.expand(b)
        if sigma.shape != (b,):
            raise ValueError(f"sigma: expected shape ({b},), got {tuple(sigma.shape)}")
        pos, neg = split_condition(condition)
        for k, v in pos.items():
            if v.shape[0] != b:
                raise ValueError(f"condition[{k!r}]: batch {v.shape[0]} != latents batch {b}")
        scale = self.cfg_scale(params)
        x = latents.to(self.device, torch.float32)
        if scale > 1.0 and not any(k.startswith(NEGATIVE_PREFIX) for k in condition):
            raise ValueError(
                f"condition: {self.cfg_param}={scale} needs the negative_* entries from encode()"
            )
        if scale > 1.0:
            packed = {k: torch.cat([neg[k], pos[k]]).to(self.device) for k in pos}
            out = self.transformer_forward(
                torch.cat([x, x]), torch.cat([sigma, sigma]), packed, params
            )
            out = out.float()
            v = self.combine_cfg(out[b:], out[:b], scale)
        else:
            cond = {k: v.to(self.device) for k, v in pos.items()}
            v = self.transformer_forward(x, sigma, cond, params).float()
        if v.shape != latents.shape:
            raise ValueError(f"velocity: shape {tuple(v.shape)} != latents {tuple(latents.shape)}")
        return v

    def replay_velocity(
        self, latents: Tensor, sigma: Tensor, condition: dict[str, Tensor], params: Any
    ) -> Tensor:
        """Training replay: the velocity for stored latents at stored sigmas under the current
        weights, with grad (same math as the rollout's :meth:`velocity`)."""
        with torch.enable_grad():
            return self.velocity(latents, sigma, condition, params)

    # ------------------------------------------------------------------ decode
    def vae_unscale(self, latents: Tensor) -> Tensor:
        """Model latents -> VAE latents: ``z / scaling_factor + shift_factor``."""
        cfg = self.component_config("vae")
        scale = getattr(cfg, "scaling_factor", 1.0) or 1.0
        shift = getattr(cfg, "shift_factor", 0.0) or 0.0
        return latents / scale + shift

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Image VAE decode to uint8 channels-last ``(B, H, W, 3)``: ``round((x/2 + 0.5) * 255)``."""
        vae = self.components["vae"]
        z = self.vae_unscale(latents.to(self.device, torch.float32)).to(vae.dtype)
        x = vae.decode(z, return_dict=False)[0]
        return to_uint8(x)


def latent_channel_stats(vae_config: Any, like: Tensor) -> tuple[Tensor, Tensor]:
    """``latents_mean`` and ``latents_std`` of a VAE that normalises each latent channel (Wan's
    and Qwen-Image's: the model's latent is ``(z - mean) / std``), shaped to broadcast over
    ``like``'s channels (dim 1)."""
    shape = (1, -1) + (1,) * (like.dim() - 2)
    mean = torch.tensor(vae_config.latents_mean, device=like.device).view(shape)
    std = torch.tensor(vae_config.latents_std, device=like.device).view(shape)
    return mean, std


def to_uint8(x: Tensor) -> Tensor:
    """``[-1, 1]`` channels-first media -> uint8 channels-last (``(B,C,H,W)`` or ``(B,C,F,H,W)``)."""
    x = ((x.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    if x.dim() == 4:
        return x.permute(0, 2, 3, 1).contiguous().cpu()
    if x.dim() == 5:
        return x.permute(0, 2, 3, 4, 1).contiguous().cpu()
    raise ValueError(f"decode: expected 4-D or 5-D media, got {tuple(x.shape)}")
