"""Per-GPU training memory estimate (bytes), from parameter counts and one training forward's
shape. An estimate to plan GPUs with, not a measurement: only a GPU run verifies it.

With ``W`` the trainable component's parameters, ``B_c`` each other loaded model's bytes
(text encoders and VAE in the weight dtype, reward models as they load), ``T`` the trained
parameters (LoRA tensors, or the fine-tuned subset), ``N`` the FSDP workers sharing the
trainable component, ``b`` the weight bytes (2 in bfloat16):

- weights: ``b W / N + sum_c B_c`` (FSDP2 shards the trainable component; text encoders,
  VAE and reward models are loaded whole on every worker);
- trained state: LoRA tensors are float32 (peft keeps adapters in float32 on a bfloat16
  model): ``16 T / N`` (weight, gradient, AdamW's two moments, 4 bytes each); full fine-tuning
  keeps gradients and AdamW moments in the weight dtype: ``3 b T / N`` on top of the weights;
- activations of one training forward/backward (``R`` rows of ``S`` tokens through ``L``
  layers of width ``H``): ``34 R S H L`` bytes in 16-bit precision with flash attention
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  eq. 1 without the ``5 a s / h`` attention-score term); with gradient checkpointing only
  each layer's input stays, ``R S H (2 L + 34)``;
- logits of an autoregressive model: ``8 R S V`` (float32 logits and their gradient,
  vocabulary ``V``);
- rollout (no grad, ``R_r`` rows): one layer's activations, ``34 R_r S H``;
- a fixed 2 GiB for the CUDA context and allocator slack.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GIB",
    "MemoryEstimate",
    "activation_bytes",
    "estimate_training_memory",
    "largest_fitting_rows",
    "model_dims",
    "sequence_tokens",
]

GIB = 2**30
#: bytes of activations per token, per hidden unit, per layer in 16-bit (Korthikanti et al.)
ACT_BYTES = 34
OVERHEAD_BYTES = 2 * GIB


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes by part (``parts``), and the inputs that produced them."""

    parts: dict[str, float]
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))

    def fits(self, gpu_bytes: float) -> bool:
        return self.total <= gpu_bytes

    def lines(self) -> list[str]:
        """One line per part, in GiB, then the total."""
        out = [f"  {k:<28} {v / GIB:9.1f} GiB" for k, v in self.parts.items()]
        out.append(f"  {'total per GPU':<28} {self.total / GIB:9.1f} GiB")
        return out


def estimate_training_memory(
    *,
    trainable_params: int,
    frozen_bytes: Mapping[str, float],
    trained_params: int,
    lora: bool,
    hidden_size: int,
    num_layers: int,
    tokens: int,
    rows: int,
    rollout_rows: int,
    shards: int = 1,
    weight_bytes: int = 2,
    gradient_checkpointing: bool = False,
    vocab_size: int = 0,
) -> MemoryEstimate:
    """The estimate of the module docstring; every count is per model (not per GPU)."""
    if shards < 1 or rows < 1 or tokens < 1:
        raise ValueError(f"shards, rows, tokens must be >= 1, got {shards}, {rows}, {tokens}")
    parts: dict[str, float] = {
        "trainable weights": weight_bytes * trainable_params / shards,
    }
    for name, n in frozen_bytes.items():
        parts[f"frozen {name}"] = float(n)
    if lora:
        parts["LoRA + grads + AdamW"] = 16.0 * trained_params / shards
    else:
        parts["grads + AdamW (full)"] = 3.0 * weight_bytes * trained_params / shards
    key = "activations (checkpointed)" if gradient_checkpointing else "activations"
    parts[key] = activation_bytes(
        rows, tokens * hidden_size, num_layers, gradient_checkpointing=gradient_checkpointing
    )
    if vocab_size:
        parts["logits"] = 8.0 * rows * tokens * vocab_size
    parts["rollout activations"] = float(rollout_rows) * tokens * hidden_size * ACT_BYTES
    parts["CUDA context + slack"] = float(OVERHEAD_BYTES)
    inputs = {
        "trainable_params": trainable_params,
        "trained_params": trained_params,
        "lora": lora,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "tokens": tokens,
        "rows": rows,
        "rollout_rows": rollout_rows,
        "shards": shards,
        "gradient_checkpointing": gradient_checkpointing,
    }
    return MemoryEstimate(parts, inputs)


def activation_bytes(
    rows: int,
    token_width: int,
    num_layers: int,
    *,
    element_bytes: int = 2,
    gradient_checkpointing: bool = False,
) -> float:
    """Activation bytes of one training forward/backward (module docstring): ``rows`` rows
    whose ``token_width`` (tokens x width entering a layer, summed over the streams of an
    MMDiT block) pass ``num_layers`` layers, ``element_bytes`` per number (the formula's 34
    bytes are for 2-byte numbers and scale with it)."""
    per_layer = float(rows) * token_width * element_bytes / 2
    if gradient_checkpointing:
        return per_layer * (2 * num_layers + ACT_BYTES)
    return per_layer * num_layers * ACT_BYTES


def largest_fitting_rows(gpu_bytes: float, **kwargs: Any) -> int:
    """The most training rows per forward that :func:`estimate_training_memory` fits in
    ``gpu_bytes`` with the other inputs as given (0: not even one row fits)."""
    lo, hi = 0, max(1, int(kwargs.get("rows", 1)))
    while estimate_training_memory(**{**kwargs, "rows": hi}).fits(gpu_bytes):
        lo, hi = hi, hi * 2
        if hi > 1 << 20:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate_training_memory(**{**kwargs, "rows": mid}).fits(gpu_bytes):
            lo = mid
        else:
            hi = mid
    return lo


def sequence_tokens(
    geometry: Mapping[str, Any],
    *,
    height: int,
    width: int,
    num_frames: int = 1,
    new_tokens: int = 0,
) -> int:
    """Tokens one sample puts through the trainable transformer, from a published model's
    ``geometry``: latent tokens ``(H / s / p) (W / s / p) F'`` with ``F' = (F - 1) / t + 1``
    latent frames, plus ``condition_images`` times the same count (edit models: each condition
    image at the output size), plus audio tokens (``audio_tokens_per_second`` at 24 fps), plus
    text tokens; an autoregressive model: ``prompt_tokens + new_tokens``."""
    if "prompt_tokens" in geometry:
        return int(geometry["prompt_tokens"]) + int(new_tokens)
    s, p = int(geometry["vae_scale"]), int(geometry["patch"])
    t = int(geometry.get("temporal_scale", 1))
    frames = (max(num_frames, 1) - 1) // t + 1
    image = math.ceil(height / (s * p)) * math.ceil(width / (s * p)) * frames
    image *= 1 + int(geometry.get("condition_images", 0))
    audio = 0
    if "audio_tokens_per_second" in geometry:
        audio = math.ceil(num_frames / 24.0 * float(geometry["audio_tokens_per_second"]))
    return image + audio + int(geometry.get("text_tokens", 0))


def model_dims(module: Any) -> tuple[int, int]:
    """(hidden width, layers) of a transformer module, from its config (diffusers or
    transformers field names); a ModuleDict of experts (Wan2.2 A14B) reports one expert
    (one runs per forward)."""
    from torch import nn

    if isinstance(module, nn.ModuleDict):
        module = next(iter(module.values()))
    cfg = module.config
    text_cfg = getattr(cfg, "text_config", None) or getattr(cfg, "llm_config", None)
    if text_cfg is not None and hasattr(text_cfg, "hidden_size"):
        cfg = text_cfg

    def get(*names: str) -> Any:
        for n in names:
            v = cfg.get(n) if isinstance(cfg, Mapping) else getattr(cfg, n, None)
            if v is not None:
                return v
        return None

    hidden = get("hidden_size")
    if hidden is None:
        heads, dim = get("num_attention_heads"), get("attention_head_dim")
        hidden = int(heads) * int(dim) if heads and dim else None
    layers = get("num_layers", "num_hidden_layers")
    if hidden is None or layers is None:
        raise ValueError(f"{type(module).__name__}: cannot read hidden size / layers from config")
    return int(hidden), int(layers)
