"""The LoRA adapter a served model needs before it can take LoRA weight updates.

A trainer pushes only the LoRA tensors (``...to_q.lora_A.weight``, ``...lora_B.weight``). The
served denoiser must carry an adapter of the same shape first: `LoraSpec` says which (rank,
alpha, target modules), and :func:`ensure_lora` adds it through the denoiser's own
``add_lora(rank, alpha, target_modules=...)`` (omni-adapters' `OmniModelBase.add_lora`: peft's
``W x + (alpha / rank) B A x`` with ``B = 0`` at first, so the model is unchanged until the
first update lands). A denoiser with ``merge_lora()`` (omni-adapters) then runs the adapter
merged into its base weights (``W0 + scale * B @ A``, recomputed from ``W0`` at every update),
so a LoRA forward costs what the base model's does. The spec comes from ``diffusion-rollout serve --lora-rank --lora-alpha
--lora-targets`` or from the first update (``RolloutClient.update_weights(..., lora_config=)``,
sent in the safetensors metadata). Alpha cannot be read off the tensors, so it is never
guessed: LoRA tensors for a model without an adapter and without a spec are an error that says
where to give one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = [
    "METADATA_KEY",
    "PLAIN_LORA_SETTINGS",
    "LoraSpec",
    "ensure_lora",
    "lora_tensor_names",
]

#: the safetensors metadata key an update carries its `LoraSpec` under (JSON)
METADATA_KEY = "lora_config"


#: peft `LoraConfig` fields whose other values change what the adapter computes (rsLoRA's
#: alpha / sqrt(r), DoRA's magnitudes, per-module ranks and alphas, trained biases, whole
#: modules saved beside the adapter), each with its plain-LoRA value: anything else is refused
PLAIN_LORA_SETTINGS: dict[str, Any] = {
    "use_rslora": False,
    "use_dora": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "bias": "none",
    "lora_bias": False,
    "modules_to_save": None,
}


@dataclass(frozen=True)
class LoraSpec:
    """``rank`` r, ``alpha`` (scale alpha / r) and the ``target_modules`` (peft names or
    suffixes; empty = the denoiser's defaults)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora_config.rank must be an integer >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise ValueError(f"lora_config.alpha must be a number, got {self.alpha!r}")
        if self.alpha <= 0:
            raise ValueError(f"lora_config.alpha must be > 0, got {self.alpha!r}")
        if isinstance(self.target_modules, str) or not all(
            isinstance(t, str) and t for t in self.target_modules
        ):
            raise ValueError(
                f"lora_config.target_modules must be a list of names, got {self.target_modules!r}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoraSpec:
        """From ``{"rank", "alpha", "target_modules"}`` or peft's ``adapter_config.json`` keys
        (``r``, ``lora_alpha``, ``target_modules``); a missing field is named, and so is a peft
        setting that changes the adapter's arithmetic from plain LoRA (`PLAIN_LORA_SETTINGS`):
        read as plain LoRA, such an adapter would sample with the wrong weights."""
        if not isinstance(data, Mapping):
            raise ValueError(f"lora_config must be an object, got {type(data).__name__}")
        peft_type = data.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise ValueError(
                f"lora_config.peft_type: only LORA adapters load here, got {peft_type!r}"
            )
        for key, plain in PLAIN_LORA_SETTINGS.items():
            value = data.get(key)
            # absent, the plain value, or empty (false, {}, []) where that is what plain means
            if not (value is None or value == plain or (not value and not isinstance(plain, str))):
                raise ValueError(
                    f"lora_config.{key}: {value!r} is not supported here (plain LoRA: "
                    f"scale alpha / r, no bias, no DoRA; {key} must be {plain!r})"
                )
        rank = data.get("rank", data.get("r"))
        alpha = data.get("alpha", data.get("lora_alpha"))
        if rank is None:
            raise ValueError("lora_config.rank is required (or peft's 'r')")
        if alpha is None:
            raise ValueError("lora_config.alpha is required (or peft's 'lora_alpha')")
        targets = data.get("target_modules") or ()
        if isinstance(targets, str):
            raise ValueError("lora_config.target_modules must be a list of names, not a string")
        return cls(rank, float(alpha), tuple(targets))

    @classmethod
    def from_json(cls, text: str) -> LoraSpec:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"lora_config is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)}


def lora_tensor_names(tensors: Mapping[str, Tensor]) -> list[str]:
    """The names of LoRA tensors (peft's ``lora_A`` / ``lora_B`` segments), sorted."""
    return sorted(n for n in tensors if ".lora_A." in n or ".lora_B." in n)


def _check_against(spec: LoraSpec, tensors: Mapping[str, Tensor]) -> None:
    """The update's own ``lora_A`` shapes must have the spec's rank (checked before the
    adapter is added, so a wrong spec changes nothing)."""
    for name in lora_tensor_names(tensors):
        t = tensors[name]
        r = t.shape[0] if ".lora_A." in name else t.shape[1]  # A: (r, in, ...), B: (out, r, ...)
        if t.ndim >= 2 and r != spec.rank:
            raise ValueError(
                f"lora_config.rank is {spec.rank} but {name} has rank {r} (shape {tuple(t.shape)})"
            )


def _current(denoiser: Any) -> LoraSpec | None:
    names = list(getattr(denoiser, "adapter_names", None) or [])
    if not names:
        return None
    cfg = denoiser.lora_config(names[0]) if hasattr(denoiser, "lora_config") else None
    if not cfg:
        return None
    targets = cfg.get("target_modules") or ()
    return LoraSpec.from_dict({**cfg, "target_modules": sorted(targets)})


def ensure_lora(
    denoiser: Any,
    spec: LoraSpec | Mapping[str, Any] | None,
    tensors: Mapping[str, Tensor] | None = None,
) -> bool:
    """Give ``denoiser`` the LoRA adapter ``spec`` describes, unless it has one; returns
    whether one was added. With ``tensors`` (an update about to load): LoRA tensors need an
    adapter, from ``spec`` or already there; a spec whose rank the tensors contradict, or one
    that differs from the adapter already added, is a ValueError naming ``lora_config``."""
    if spec is not None and not isinstance(spec, LoraSpec):
        spec = LoraSpec.from_dict(spec)
    lora_names = lora_tensor_names(tensors or {})
    current = _current(denoiser)
    if spec is None:
        # a denoiser that does not list its adapters (not omni-adapters) is left to its
        # load_weights to judge the names
        if lora_names and current is None and hasattr(denoiser, "adapter_names"):
            raise ValueError(
                f"lora_config: the update holds LoRA tensors (e.g. {lora_names[0]}) but the "
                "served model has no LoRA adapter; start `diffusion-rollout serve` with "
                "--lora-rank/--lora-alpha/--lora-targets, or pass lora_config={rank, alpha, "
                "target_modules} with the first update"
            )
        return False
    _check_against(spec, tensors or {})
    if current is not None:
        same = (current.rank, current.alpha) == (spec.rank, spec.alpha) and (
            not spec.target_modules or sorted(spec.target_modules) == list(current.target_modules)
        )
        if not same:
            raise ValueError(
                f"lora_config: the served model already has a LoRA adapter {current.to_dict()}, "
                f"the update asks for {spec.to_dict()}"
            )
        return False
    add = getattr(denoiser, "add_lora", None)
    if not callable(add):
        raise ValueError(
            f"lora_config: {type(denoiser).__name__} cannot add a LoRA adapter (no add_lora)"
        )
    targets: Sequence[str] | None = list(spec.target_modules) or None
    add(spec.rank, spec.alpha, target_modules=targets)
    merge = getattr(denoiser, "merge_lora", None)
    if callable(merge):  # a served model only samples: run the adapter merged
        merge()
    return True
