"""`OmniModelBase`, the adapter registry and `from_pretrained`.

An adapter owns everything model-specific: how the model is built or loaded, which
submodules a stage needs, which parameters train, where LoRA goes, how FSDP2 shards it,
and the names/dtype the rollout engine expects for a weight sync. The trainer, the rollout
engine and the losses only talk to this interface, so they never special-case a model.

The registry is a plain dict keyed by ``(architecture, stage)``: ``architecture`` is the
class name a saved model declares (``model_index.json`` ``_class_name`` for diffusers
pipelines, ``config.json`` ``architectures[0]`` for transformers models), ``stage`` names
the part of a multi-stage model the adapter drives (``"default"`` for single-stage models,
``"thinker"`` for the Qwen3-Omni thinker, ...).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import json
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from .lora_folding import fold_lora_linears, folded_weight
from .rms_norm_fusing import fuse_rms_norms

__all__ = [
    "ADAPTERS",
    "DEFAULT_STAGE",
    "FAMILY_MODULES",
    "MergedLinear",
    "OmniModelBase",
    "adapter_for",
    "component_class",
    "from_pretrained",
    "is_saved_model",
    "load_family_modules",
    "load_module",
    "model_index_entries",
    "module_dtype",
    "read_adapter_options",
    "read_architecture",
    "register_adapter",
    "resolve_dtype",
    "weights_checksum",
    "write_adapter_options",
]

DEFAULT_STAGE = "default"
#: optional file next to a saved model with default adapter options
ADAPTER_OPTIONS_FILE = "omni_adapter.json"

#: (architecture, stage) -> adapter class. Filled by :func:`register_adapter`.
ADAPTERS: dict[tuple[str, str], type[OmniModelBase]] = {}

#: family name -> module that defines (and registers) its adapter and tiny builder.
#: ``from_pretrained`` and ``tiny.build`` import these lazily, so importing
#: ``omni_adapters`` stays cheap.
FAMILY_MODULES: dict[str, str] = {
    "sd3": "omni_adapters.families.sd3",
    "qwen_image": "omni_adapters.families.qwen_image",
    "qwen_image_edit": "omni_adapters.families.qwen_image_edit",
    "qwen_image_edit_plus": "omni_adapters.families.qwen_image_edit_plus",
    "wan22": "omni_adapters.families.wan22",
    "wan22_a14b": "omni_adapters.families.wan22",
    "ltx2": "omni_adapters.families.ltx2",
    "bagel": "omni_adapters.families.bagel",
    "qwen3_omni_thinker": "omni_adapters.families.qwen3_omni_thinker",
}

#: architecture -> the files that mark a released layout with no model_index/config.json
#: architecture entry (BAGEL-7B-MoT ships llm_config.json, vit_config.json, ema.safetensors,
#: ae.safetensors and a config.json without "architectures")
RELEASE_LAYOUTS: dict[str, tuple[str, ...]] = {
    "Bagel": ("llm_config.json", "vit_config.json"),
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

#: parameter-name segments peft uses for LoRA tensors (``...to_q.lora_A.<adapter>.weight``).
_LORA_KEYS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Hide the diffusers/transformers progress bars (shard writing/loading) for a block,
    restoring the previous setting afterwards."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    was = (dlog.is_progress_bar_enabled(), tlog.is_progress_bar_enabled())
    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        if was[0]:
            dlog.enable_progress_bar()
        if was[1]:
            tlog.enable_progress_bar()


def resolve_dtype(
    dtype: str | torch.dtype | None, default: torch.dtype = torch.float32
) -> torch.dtype:
    """Turn ``"bfloat16"``/``"bf16"``/``torch.bfloat16``/None into a torch dtype."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(
            f"dtype: unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}"
        ) from None


def register_adapter(
    architecture: str, stage: str = DEFAULT_STAGE, *, family: str | None = None
) -> Callable[[type[OmniModelBase]], type[OmniModelBase]]:
    """Class decorator: register an adapter for ``(architecture, stage)``.

    >>> @register_adapter("StableDiffusion3Pipeline", family="sd3")
    ... class SD3Adapter(DiffusionAdapter): ...

    Registering the same key twice with a different class is an error (two adapters would
    silently shadow each other otherwise).
    """

    def decorate(cls: type[OmniModelBase]) -> type[OmniModelBase]:
        key = (architecture, stage)
        old = ADAPTERS.get(key)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(
                f"register_adapter: {key} is already registered to {old.__module__}.{old.__qualname__}"
            )
        ADAPTERS[key] = cls
        cls.architecture = architecture
        cls.stage = stage
        if family is not None:
            cls.family = family
        return cls

    return decorate


def load_family_modules(families: Sequence[str] | None = None) -> None:
    """Import the family modules so their ``register_adapter`` decorators run.

    A family whose module file does not exist is skipped; any other import error is raised.
    """
    names = list(FAMILY_MODULES) if families is None else list(families)
    for fam in names:
        if fam not in FAMILY_MODULES:
            raise ValueError(f"family: unknown family {fam!r}; known: {sorted(FAMILY_MODULES)}")
        modname = FAMILY_MODULES[fam]
        try:
            importlib.import_module(modname)
        except ModuleNotFoundError as err:
            if err.name != modname:
                raise


def read_architecture(path: str | os.PathLike[str]) -> str:
    """The architecture a saved model declares.

    ``model_index.json`` ``_class_name`` (a diffusers pipeline folder) wins over
    ``config.json`` ``architectures[0]`` (a transformers model folder). A folder in a released
    layout without either is recognised by its files (:data:`RELEASE_LAYOUTS`, e.g. BAGEL's
    ``llm_config.json`` + ``vit_config.json``).
    """
    root = Path(path)
    for arch, files in RELEASE_LAYOUTS.items():
        if all((root / f).is_file() for f in files):
            return arch
    index = root / "model_index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        name = data.get("_class_name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{index}: field '_class_name' is missing or not a string")
        return name
    config = root / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        archs = data.get("architectures")
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise ValueError(f"{config}: field 'architectures' is missing or empty")
        return archs[0]
    raise FileNotFoundError(f"{root}: neither model_index.json nor config.json found")


def is_saved_model(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a model :func:`from_pretrained` can read (a diffusers pipeline,
    a transformers model, or a released layout such as BAGEL's)."""
    try:
        read_architecture(path)
    except (FileNotFoundError, ValueError, json.JSONDecodeError):
        return False
    return True


def read_adapter_options(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Default adapter options saved next to a model (``omni_adapter.json`` ``options``), e.g.
    the tiny models' short text length. Options passed to ``from_pretrained`` override them."""
    f = Path(path) / ADAPTER_OPTIONS_FILE
    if not f.is_file():
        return {}
    data = json.loads(f.read_text())
    opts = data.get("options", {})
    if not isinstance(opts, dict):
        raise ValueError(f"{f}: field 'options' must be an object")
    return opts


def write_adapter_options(path: str | os.PathLike[str], **options: Any) -> None:
    """Write ``omni_adapter.json`` with default adapter options for the model at ``path``."""
    f = Path(path) / ADAPTER_OPTIONS_FILE
    f.write_text(json.dumps({"options": options}, indent=2, sort_keys=True) + "\n")


def adapter_for(architecture: str, stage: str | None = None) -> type[OmniModelBase]:
    """Look up the adapter class for an architecture (and stage).

    With ``stage=None``: the ``"default"`` stage if registered, else the only registered stage;
    several stages and no default is an error that lists them.
    """
    if not any(a == architecture for a, _ in ADAPTERS):
        load_family_modules()
    stages = {s: cls for (a, s), cls in ADAPTERS.items() if a == architecture}
    if not stages:
        known = sorted({a for a, _ in ADAPTERS})
        raise ValueError(
            f"architecture: no adapter registered for {architecture!r}; known: {known}"
        )
    if stage is None:
        if DEFAULT_STAGE in stages:
            return stages[DEFAULT_STAGE]
        if len(stages) == 1:
            return next(iter(stages.values()))
        raise ValueError(
            f"stage: {architecture!r} has several stages {sorted(stages)}; pass stage=..."
        )
    if stage not in stages:
        raise ValueError(f"stage: {architecture!r} has no stage {stage!r}; known: {sorted(stages)}")
    return stages[stage]


def from_pretrained(path: str | os.PathLike[str], **options: Any) -> OmniModelBase:
    """Load a saved model (real or tiny) into its registered adapter.

    The adapter is chosen from the folder's own config (see :func:`read_architecture`);
    ``stage=`` selects among stages; every other option goes to the adapter's
    ``from_pretrained`` (``dtype``, ``device``, ``gradient_checkpointing``, ``strip``, ...).
    """
    stage = options.pop("stage", None)
    arch = read_architecture(path)
    cls = adapter_for(arch, stage)
    return cls.from_pretrained(path, **options)


def _has_files(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def module_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a model computes in: that of its first floating-point parameter outside its
    ``_keep_in_fp32_modules``, as diffusers' ``ModelMixin.dtype`` answers.

    ``ModelMixin.dtype`` first walks every submodule looking for layerwise-casting hooks
    (omni-rl attaches none); on a peft-wrapped transformer that walk took about 3.5 ms a call,
    paid on every forward of the update: 14 % of a tiny model's update
    (docs/performance.md). Equal to it on every family's tiny model, peft-wrapped and in
    bfloat16 (packages/omni-adapters/tests/test_module_dtype.py)."""
    keep = getattr(module, "_keep_in_fp32_modules", None) or ()
    last = None
    for name, param in module.named_parameters():
        last = param.dtype
        if any(k in name for k in keep):
            continue
        if param.is_floating_point():
            return param.dtype
    if last is None:
        raise ValueError(f"module_dtype: {type(module).__name__} has no parameters")
    return last


def load_module(
    klass: type[nn.Module],
    folder: str | os.PathLike[str],
    *,
    dtype: torch.dtype,
    device: torch.device,
    allow_unexpected: Sequence[str] = (),
    **kwargs: Any,
) -> nn.Module:
    """A diffusers ``ModelMixin`` or transformers ``PreTrainedModel`` from a saved folder.

    Strict: a missing, unexpected (unless it starts with one of ``allow_unexpected``) or
    mis-shaped tensor is a :class:`~omni_adapters.checkpoints.CheckpointKeyError` naming it
    (both libraries would otherwise initialise it at random and only warn). On the ``meta``
    device only ``config.json`` is read: the module is built at full size without weights
    (the architecture checks in docs/models.md)."""
    from .checkpoints import check_loading_info

    folder = Path(folder)
    diffusers_model = _is_diffusers_model(klass)
    if device.type == "meta":
        with torch.device("meta"):
            if diffusers_model:
                obj = klass.from_config(klass.load_config(folder), **kwargs)
            else:
                config = klass.config_class.from_pretrained(folder, **kwargs)
                obj = klass._from_config(config, dtype=dtype)
        if next(obj.parameters()).dtype != dtype:
            obj = obj.to(dtype=dtype)
        return obj.eval()
    key = "torch_dtype" if diffusers_model else "dtype"
    # no pickle: a folder that only has a .bin checkpoint is an error, never a torch.load
    kwargs.setdefault("use_safetensors", True)
    obj, info = klass.from_pretrained(folder, output_loading_info=True, **{key: dtype}, **kwargs)
    check_loading_info(str(folder), info, allow_unexpected=allow_unexpected)
    return obj.to(device).eval()


def _is_diffusers_model(klass: type) -> bool:
    try:
        from diffusers import ModelMixin
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return False
    return issubclass(klass, ModelMixin)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = _full(t).to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: DTensors (FSDP2 shards) are all-gathered."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def weights_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the sorted names, and each tensor's dtype, shape and raw bytes.

    Both sides of a weight sync compute it; equal strings mean equal weights bit for bit.
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


def _tuner_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in module.named_modules() if isinstance(m, BaseTunerLayer)]


def _adapter_param_names(module: nn.Module, adapter_name: str) -> dict[str, str]:
    """full parameter name -> exported name (the ``.<adapter_name>`` segment removed)."""
    out: dict[str, str] = {}
    for name, _ in module.named_parameters():
        parts = name.split(".")
        for i in range(len(parts) - 1):
            if parts[i] in _LORA_KEYS and parts[i + 1] == adapter_name:
                out[name] = ".".join(parts[: i + 1] + parts[i + 2 :])
                break
        else:
            # lora_magnitude_vector is a ParameterDict: ...lora_magnitude_vector.<adapter>
            if len(parts) >= 2 and parts[-2] in _LORA_KEYS and parts[-1] == adapter_name:
                out[name] = ".".join(parts[:-1])
    return out


@dataclass
class MergedLinear:
    """One LoRA layer of a merged rollout copy: the plain ``layer`` that runs the forward with
    weight ``W0 + scale * B @ A``, its base weight ``W0`` (kept, never written) and the LoRA
    ``scale`` (peft's ``scaling``: alpha / r, or alpha / sqrt(r) with rsLoRA)."""

    layer: nn.Linear
    base: torch.Tensor
    scale: float


def model_index_entries(path: Path, skip: Sequence[str] = ()) -> list[tuple[str, str, str]]:
    """``(name, library, class_name)`` of each component in ``path / "model_index.json"``
    (diffusers' pipeline index, ``name: [library, class]``), without its ``_`` keys, the names
    in ``skip`` and the ``[null, null]`` entries of components a pipeline was saved without."""
    index = path / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{index} not found (override load_components)")
    return [
        (name, entry[0], entry[1])
        for name, entry in json.loads(index.read_text()).items()
        if not name.startswith("_")
        and name not in skip
        and isinstance(entry, list)
        and len(entry) == 2
        and entry[0] is not None
    ]


def component_class(path: Path, name: str, library: str, class_name: str) -> Any:
    """The class a ``model_index.json`` entry names, imported from ``library``."""
    klass = getattr(importlib.import_module(library), class_name, None)
    if klass is None:
        raise ValueError(
            f"{path / 'model_index.json'}: component {name!r}: {library}.{class_name} not found"
        )
    return klass


class OmniModelBase:
    """Base of every adapter: model setup, tokenizer config, trainable stage, LoRA, FSDP,
    rollout alignment.

    Subclasses set the class attributes and implement :meth:`load_components`; the rest is
    shared. ``components`` maps names (``"transformer"``, ``"vae"``, ``"text_encoder"``,
    ``"tokenizer"``, ``"scheduler"``, ``"thinker"``, ...) to loaded objects.
    """

    #: set by :func:`register_adapter`
    architecture: ClassVar[str] = ""
    stage: ClassVar[str] = DEFAULT_STAGE
    family: ClassVar[str] = ""
    #: the component that trains and whose weights sync to the rollout engine
    trainable_component: ClassVar[str] = "transformer"
    #: default LoRA target module names (peft ``target_modules``: suffixes / regex)
    lora_target_modules: ClassVar[tuple[str, ...]] = ()
    #: default peft ``exclude_modules``
    lora_exclude_modules: ClassVar[tuple[str, ...]] = ()
    #: class names of FSDP2 wrap units (each instance becomes one ``fully_shard`` unit)
    no_split_modules: ClassVar[tuple[str, ...]] = ()
    #: FSDP2 mixed precision: parameter (compute) dtype, gradient-reduce dtype, output dtype
    mixed_precision: ClassVar[dict[str, str | None]] = {
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "output_dtype": None,
    }
    #: components a stage does not use and drops at load time (e.g. the Omni talker)
    unused_components: ClassVar[tuple[str, ...]] = ()
    #: prefix vllm-omni's LoRA loader expects (peft's saved-adapter layout)
    vllm_omni_prefix: ClassVar[str] = "base_model.model."

    def __init__(
        self,
        components: dict[str, Any],
        *,
        path: str | os.PathLike[str] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        options: dict[str, Any] | None = None,
    ) -> None:
        if self.trainable_component not in components:
            raise ValueError(
                f"components: {type(self).__name__} needs component {self.trainable_component!r}; "
                f"got {sorted(components)}"
            )
        self.components = dict(components)
        self.path = None if path is None else Path(path)
        self.dtype = dtype
        self.device = torch.device(device)
        self.options = dict(options or {})
        self.train_mode = "frozen"
        self._lora_configs: dict[str, Any] = {}
        self._trainable_adapter: str | None = None
        #: merged rollout mode (:meth:`merge_lora`): layer name -> MergedLinear, and the LoRA
        #: tensors merged now (exported names); None for a peft (unmerged) model
        self._merged: dict[str, MergedLinear] | None = None
        self._merged_lora: dict[str, torch.Tensor] = {}
        self.freeze_all()

    # ------------------------------------------------------------------ model setup
    @classmethod
    def load_components(
        cls, path: Path, *, dtype: torch.dtype, device: torch.device, skip: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Load the model's components from ``path`` (family-specific).

        The default reads a diffusers ``model_index.json``: each ``name: [library, class]``
        entry is loaded with ``<library>.<class>.from_pretrained(path / name)``; names in
        ``skip`` are not loaded.
        """
        out: dict[str, Any] = {}
        for name, library, class_name in model_index_entries(path, skip):
            klass = component_class(path, name, library, class_name)
            sub = path / name
            if isinstance(klass, type) and issubclass(klass, nn.Module):
                if device.type == "meta" and not (sub / "config.json").is_file():
                    continue  # a config-only folder may describe only some components
                out[name] = load_module(klass, sub, dtype=dtype, device=device)
            elif device.type == "meta" and not _has_files(sub):
                continue
            else:
                out[name] = klass.from_pretrained(sub)
        return out

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        gradient_checkpointing: bool = False,
        strip: Sequence[str] = (),
        **options: Any,
    ) -> OmniModelBase:
        """Model setup: load the components from ``path`` in ``dtype`` on ``device``, drop the
        stage's unused components plus ``strip``, optionally enable gradient checkpointing.
        Every parameter starts frozen; call :meth:`add_lora` or :meth:`set_trainable`.

        ``device="meta"`` reads only the configs and builds the modules at full size without
        weights (components whose config is absent are left out): parameter counts, LoRA
        targets, FSDP units and memory estimates of a released model without downloading it
        (:mod:`omni_adapters.published`)."""
        root = Path(path)
        dt = resolve_dtype(dtype)
        dev = torch.device(device or "cpu")
        skip = tuple(cls.unused_components) + tuple(strip)
        if cls.trainable_component in skip:
            raise ValueError(
                f"strip: cannot strip the trainable component {cls.trainable_component!r}"
            )
        with quiet_progress():
            comps = cls.load_components(root, dtype=dt, device=dev, skip=skip)
        merged = {**read_adapter_options(root), **options}
        adapter = cls(comps, path=root, dtype=dt, device=dev, options=merged)
        if gradient_checkpointing:
            adapter.enable_gradient_checkpointing()
        return adapter

    @property
    def model(self) -> nn.Module:
        """The trainable component (the transformer, or the thinker)."""
        return self.components[self.trainable_component]

    def component_config(self, name: str) -> Any:
        """A component's config, also when the component was stripped (then read from
        ``<path>/<name>/config.json``), so e.g. latent shapes still follow the VAE."""
        comp = self.components.get(name)
        if comp is not None and hasattr(comp, "config"):
            return comp.config
        cache = self.__dict__.setdefault("_config_cache", {})
        if name not in cache:
            f = None if self.path is None else self.path / name / "config.json"
            if f is None or not f.is_file():
                raise ValueError(f"component {name!r}: not loaded and no saved config.json")
            from diffusers.configuration_utils import FrozenDict

            cache[name] = FrozenDict(json.loads(f.read_text()))
        return cache[name]

    def strip_modules(self, names: Sequence[str]) -> list[str]:
        """Drop components (or dotted submodules of the trainable model) a stage does not use.

        Returns the names removed; a name that is not there is an error.
        """
        removed = []
        for name in names:
            if name in self.components:
                if name == self.trainable_component:
                    raise ValueError(f"strip: cannot strip the trainable component {name!r}")
                del self.components[name]
            else:
                parent_name, _, child = name.rpartition(".")
                parent = self.model.get_submodule(parent_name) if parent_name else self.model
                if not hasattr(parent, child):
                    raise ValueError(f"strip: {name!r} is neither a component nor a submodule")
                delattr(parent, child)
            removed.append(name)
        return removed

    def enable_gradient_checkpointing(self) -> None:
        """Turn on activation checkpointing in the trainable model (diffusers/transformers API)."""
        m = self.model
        if hasattr(m, "enable_gradient_checkpointing"):
            m.enable_gradient_checkpointing()
        elif hasattr(m, "gradient_checkpointing_enable"):
            m.gradient_checkpointing_enable()
        else:
            raise ValueError(f"{type(m).__name__} has no gradient checkpointing switch")

    def to(self, device: str | torch.device) -> OmniModelBase:
        """Move every module component (and a merged model's base weights) to ``device``."""
        self.device = torch.device(device)
        for v in self.components.values():
            if isinstance(v, nn.Module):
                v.to(self.device)
        for m in (self._merged or {}).values():
            m.base = m.base.to(self.device)
        return self

    # ------------------------------------------------------- processor / tokenizer
    def tokenizer_config(self) -> dict[str, Any]:
        """Processor and tokenizer configuration: for each tokenizer/processor component, its
        class, max length, padding side and special-token ids. Families extend it."""
        out: dict[str, Any] = {}
        for name, obj in self.components.items():
            if "tokenizer" in name or "processor" in name:
                tok = getattr(obj, "tokenizer", obj)
                out[name] = {
                    "class": type(obj).__name__,
                    "model_max_length": getattr(tok, "model_max_length", None),
                    "padding_side": getattr(tok, "padding_side", None),
                    "pad_token_id": getattr(tok, "pad_token_id", None),
                    "eos_token_id": getattr(tok, "eos_token_id", None),
                }
        return out

    # --------------------------------------------------------- trainable selection
    def freeze_all(self) -> None:
        """Freeze every parameter of every module component."""
        for v in self.components.values():
            if isinstance(v, nn.Module):
                v.requires_grad_(False)

    def set_trainable(self, mode: str = "lora", *, modules: Sequence[str] = ()) -> int:
        """Trainable-stage selection. ``mode``:

        - ``"lora"``: only the trainable adapter's LoRA tensors train (after :meth:`add_lora`);
        - ``"full"``: every parameter of the trainable component (or only the submodules
          whose dotted names start with one of ``modules``) trains;
        - ``"frozen"``: nothing trains (reference / rollout-only copy).

        Returns the number of trainable parameters (elements)."""
        self.freeze_all()
        if mode == "frozen":
            pass
        elif mode == "lora":
            if self._trainable_adapter is None:
                raise ValueError("mode: 'lora' needs add_lora(...) first")
            for full in _adapter_param_names(self.model, self._trainable_adapter):
                self.model.get_parameter(full).requires_grad_(True)
        elif mode == "full":
            if self._lora_configs:
                raise ValueError("mode: 'full' with LoRA adapters present; pick one")
            named = dict(self.model.named_parameters())
            picked = [
                n
                for n in named
                if not modules or any(n == m or n.startswith(m + ".") for m in modules)
            ]
            if not picked:
                raise ValueError(f"modules: {list(modules)} match no parameter of the model")
            for n in picked:
                named[n].requires_grad_(True)
        else:
            raise ValueError(f"mode: expected 'lora', 'full' or 'frozen', got {mode!r}")
        self.train_mode = mode
        return sum(p.numel() for p in self.trainable_parameters())

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters of the trainable component with ``requires_grad`` (optimizer input)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Like :meth:`trainable_parameters`, keyed by the name inside the trainable model."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    # ------------------------------------------------------------------- LoRA
    def add_lora(
        self,
        rank: int = 8,
        alpha: float | None = None,
        *,
        target_modules: Sequence[str] | str | None = None,
        exclude_modules: Sequence[str] | str | None = None,
        adapter_name: str = "default",
        dropout: float = 0.0,
        init_lora_weights: bool | str = True,
        trainable: bool = True,
    ) -> int:
        """Inject a peft LoRA adapter into the trainable model; return how many modules it wraps.

        ``W x + (alpha / rank) * B A x`` (Hu et al. 2021, LoRA), ``B`` initialised to zero so the
        adapted model starts equal to the base. ``target_modules`` defaults to the family's
        ``lora_target_modules``. Binding zero modules is an error (a wrong target list must not
        train nothing silently). With ``trainable=True`` this adapter becomes the one that
        trains, is active in the forward, and is the one exported to the rollout engine.
        """
        from peft import LoraConfig, inject_adapter_in_model

        if rank <= 0:
            raise ValueError(f"rank: must be > 0, got {rank}")
        self._refuse_merged("add_lora")
        if adapter_name in self._lora_configs:
            raise ValueError(f"adapter_name: adapter {adapter_name!r} already exists")
        targets = self.lora_target_modules if target_modules is None else target_modules
        excludes = self.lora_exclude_modules if exclude_modules is None else exclude_modules
        if not targets:
            raise ValueError(
                f"target_modules: {type(self).__name__} has no LoRA targets; pass some"
            )
        cfg = LoraConfig(
            r=rank,
            lora_alpha=float(rank if alpha is None else alpha),
            target_modules=targets if isinstance(targets, str) else list(targets),
            exclude_modules=(excludes if isinstance(excludes, str) else list(excludes)) or None,
            lora_dropout=dropout,
            init_lora_weights=init_lora_weights,
        )
        prev_active = self.active_adapter()
        try:
            with warnings.catch_warnings():
                # a second named adapter ("old") is intended; peft warns about it
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                # on the meta device (architecture checks) the LoRA tensors are meta too
                meta = self.device.type == "meta"
                with torch.device(self.device) if meta else contextlib.nullcontext():
                    inject_adapter_in_model(cfg, self.model, adapter_name=adapter_name)
        except ValueError as err:
            raise ValueError(
                f"target_modules: LoRA adapter {adapter_name!r} binds 0 modules of "
                f"{type(self.model).__name__} (targets={cfg.target_modules}, "
                f"exclude={cfg.exclude_modules}): {err}"
            ) from err
        count = self.lora_module_count(adapter_name)
        if count == 0:
            raise ValueError(
                f"target_modules: LoRA adapter {adapter_name!r} binds 0 modules "
                f"(targets={cfg.target_modules}, exclude={cfg.exclude_modules})"
            )
        for p in _adapter_param_names(self.model, adapter_name):
            self.model.get_parameter(p).data = self.model.get_parameter(p).data.to(
                device=self.device
            )
        self._lora_configs[adapter_name] = cfg
        # the training forward with the adapter folded into the matmul's weight where the
        # formula allows (float32, one plain adapter), and the frozen RMSNorms in one fused
        # kernel with a hand-written backward: fewer passes over the activations
        fold_lora_linears(self.model)
        fuse_rms_norms(self.model)
        if trainable:
            self._trainable_adapter = adapter_name
            self._activate(adapter_name)
            self.set_trainable("lora")
        else:
            self._activate(prev_active or adapter_name)
            self._restore_grads()
        return count

    def lora_module_count(self, adapter_name: str = "default") -> int:
        """How many modules carry LoRA adapter ``adapter_name``."""
        n = 0
        for _, layer in _tuner_layers(self.model):
            lora_a = getattr(layer, "lora_A", None)
            emb_a = getattr(layer, "lora_embedding_A", None)
            if (lora_a is not None and adapter_name in lora_a) or (
                emb_a is not None and adapter_name in emb_a
            ):
                n += 1
        return n

    def lora_config(self, adapter_name: str = "default") -> dict[str, Any]:
        """The peft ``adapter_config.json`` content for an adapter (what vllm-omni reads)."""
        cfg = self._lora_configs.get(adapter_name)
        if cfg is None:
            raise ValueError(f"adapter_name: no LoRA adapter {adapter_name!r}")
        d = cfg.to_dict()
        return json.loads(
            json.dumps(d, default=lambda o: sorted(o) if isinstance(o, set) else str(o))
        )

    @property
    def adapter_names(self) -> list[str]:
        """Names of the LoRA adapters present."""
        return list(self._lora_configs)

    def active_adapter(self) -> str | None:
        """The adapter the forward uses now (None without LoRA)."""
        for _, layer in _tuner_layers(self.model):
            return layer.active_adapters[0]
        return None

    def _activate(self, adapter_name: str) -> None:
        for _, layer in _tuner_layers(self.model):
            layer.set_adapter(adapter_name)

    def _restore_grads(self) -> None:
        if self.train_mode == "lora" and self._trainable_adapter is not None:
            self.set_trainable("lora")
        elif self.train_mode == "frozen":
            self.freeze_all()
        # "full": peft never touches the base weights' flags

    def adapter_state(self, adapter_name: str = "default") -> dict[str, torch.Tensor]:
        """LoRA tensors of one adapter, keyed by the exported (adapter-free) name."""
        if adapter_name not in self._lora_configs:
            raise ValueError(f"adapter_name: no LoRA adapter {adapter_name!r}")
        if self._merged is not None:
            return dict(self._merged_lora)
        return {
            short: self.model.get_parameter(full)
            for full, short in _adapter_param_names(self.model, adapter_name).items()
        }

    def add_adapter_copy(self, source: str = "default", name: str = "old") -> int:
        """Create adapter ``name`` with ``source``'s config and weights (e.g. the "old" policy of
        a PPO-style ratio); it does not train. Returns the module count."""
        if source not in self._lora_configs:
            raise ValueError(f"source: no LoRA adapter {source!r}")
        cfg = self._lora_configs[source]
        count = self.add_lora(
            cfg.r,
            cfg.lora_alpha,
            target_modules=cfg.target_modules
            if isinstance(cfg.target_modules, str)
            else sorted(cfg.target_modules),
            exclude_modules=cfg.exclude_modules
            if isinstance(cfg.exclude_modules, str) or cfg.exclude_modules is None
            else sorted(cfg.exclude_modules),
            adapter_name=name,
            dropout=cfg.lora_dropout,
            trainable=False,
        )
        self.copy_adapter(source, name)
        return count

    @torch.no_grad()
    def copy_adapter(self, source: str, target: str) -> None:
        """``target <- source`` for every LoRA tensor."""
        self.ema_adapter(source, target, decay=0.0)

    @torch.no_grad()
    def ema_adapter(self, source: str, target: str, decay: float) -> None:
        """Exponential moving average: ``target <- decay * target + (1 - decay) * source``."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay: must be in [0, 1], got {decay}")
        src = self.adapter_state(source)
        dst = self.adapter_state(target)
        if set(src) != set(dst):
            raise ValueError(f"adapters {source!r} and {target!r} have different tensors")
        for k, t in dst.items():
            if decay == 0.0:
                t.copy_(src[k])
            else:
                t.mul_(decay).add_(src[k].to(t.dtype), alpha=1.0 - decay)

    @contextlib.contextmanager
    def use_adapter(self, adapter_name: str) -> Iterator[None]:
        """Run the forward with another LoRA adapter (e.g. ``"old"``); restores the active
        adapter and the ``requires_grad`` flags afterwards."""
        if adapter_name not in self._lora_configs:
            raise ValueError(f"adapter_name: no LoRA adapter {adapter_name!r}")
        self._refuse_merged("use_adapter")
        prev = self.active_adapter()
        self._activate(adapter_name)
        try:
            yield
        finally:
            self._activate(prev or adapter_name)
            self._restore_grads()

    @contextlib.contextmanager
    def disabled_adapters(self) -> Iterator[None]:
        """The reference policy: the base model with every LoRA adapter disabled."""
        self._refuse_merged("disabled_adapters")
        layers = _tuner_layers(self.model)
        for _, layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for _, layer in layers:
                layer.enable_adapters(True)
            self._restore_grads()

    reference_policy = disabled_adapters

    # ------------------------------------------------------ merged LoRA (rollout)
    @property
    def is_merged(self) -> bool:
        """Whether this is a merged rollout model (:meth:`merge_lora`)."""
        return self._merged is not None

    @property
    def merged_layers(self) -> dict[str, MergedLinear]:
        """Layer name -> `MergedLinear` of a merged rollout model (empty when not merged)."""
        return dict(self._merged or {})

    def _refuse_merged(self, what: str) -> None:
        if self._merged is not None:
            raise ValueError(
                f"{what}: this adapter runs its LoRA merged (a rollout copy, merge_lora); "
                "use the trainer's unmerged adapter"
            )

    def lora_base_params(self, adapter_name: str | None = None) -> int:
        """Elements of the base weights of the layers LoRA adapter ``adapter_name`` (default:
        the trainable one) wraps: what a merged rollout copy holds a second time."""
        name = adapter_name or self._trainable_adapter
        return sum(
            layer.get_base_layer().weight.numel()
            for _, layer in _tuner_layers(self.model)
            if name in getattr(layer, "lora_A", {})
        )

    def merged_rollout_copy(self, adapter_name: str | None = None) -> OmniModelBase:
        """A rollout-only copy of this LoRA policy whose forwards run on merged weights.

        It shares every component and every parameter and buffer with this adapter except
        the weights of the LoRA-wrapped layers, which it holds merged (:meth:`merge_lora`):
        the extra memory is one copy of those layers' weights. This adapter stays the
        unmerged peft model the trainer trains; the copy follows it through
        ``load_weights(export_rollout_weights())``. Not for FSDP-sharded models."""
        self._refuse_merged("merged_rollout_copy")
        shared = {id(t): t for t in (*self.model.parameters(), *self.model.buffers())}
        out = copy.copy(self)
        out.components = dict(self.components)
        out.components[self.trainable_component] = copy.deepcopy(self.model, shared)
        out.options = dict(self.options)
        out._lora_configs = dict(self._lora_configs)
        out.merge_lora(adapter_name)
        return out

    @torch.no_grad()
    def merge_lora(self, adapter_name: str | None = None) -> int:
        """Turn this adapter into a rollout model that runs LoRA adapter ``adapter_name``
        (default: the trainable one) merged into the base weights; returns how many layers.

        Each peft LoRA ``Linear`` becomes its plain base layer with its own weight
        ``W = W0 + scale * B @ A`` (LoRA, Hu et al. 2021: the same function as
        ``W0 x + scale * B A x``), so a forward costs what the base model's does. ``W0`` is
        kept and every :meth:`load_weights` recomputes ``W`` from it in float32: loading twice
        never accumulates, and ``B = 0`` gives ``W0`` back bit for bit. Other adapters are
        dropped; training, ``use_adapter`` and ``disabled_adapters`` are refused afterwards.
        Only LoRA on ``nn.Linear`` without DoRA merges (the families' targets); anything else
        is a ValueError naming the layer, raised before the model changes."""
        from peft.tuners.lora import Linear as LoraLinear

        self._refuse_merged("merge_lora")
        name = adapter_name or self._trainable_adapter
        if name is None or name not in self._lora_configs:
            raise ValueError(f"adapter_name: no LoRA adapter {name!r} to merge (add_lora first)")
        layers = _tuner_layers(self.model)
        for full, layer in layers:
            ok = (
                isinstance(layer, LoraLinear)
                and isinstance(layer.get_base_layer(), nn.Linear)
                and not layer.fan_in_fan_out
                and not layer.use_dora.get(name, False)
            )
            if not ok:
                raise ValueError(
                    f"merge_lora: {full} ({type(layer).__name__}) cannot be merged; only LoRA "
                    "on nn.Linear layers without DoRA can"
                )
        current = {k: v.detach() for k, v in self.adapter_state(name).items()}
        merged: dict[str, MergedLinear] = {}
        for full, layer in layers:
            base = layer.get_base_layer()
            w0 = base.weight.detach()
            base.weight = nn.Parameter(w0.clone(), requires_grad=False)
            parent, _, child = full.rpartition(".")
            setattr(self.model.get_submodule(parent) if parent else self.model, child, base)
            if name in layer.lora_A:
                merged[full] = MergedLinear(base, w0, float(layer.scaling[name]))
        self._merged = merged
        self._lora_configs = {name: self._lora_configs[name]}
        self._trainable_adapter = name
        self.train_mode = "frozen"
        self.freeze_all()
        self._merge_into(current)
        return len(merged)

    @torch.no_grad()
    def _merge_into(self, lora: dict[str, torch.Tensor]) -> None:
        """``W = W0 + scale * B @ A`` for every merged layer from the LoRA tensors ``lora``
        (exported names, already checked); keeps them as the merged state."""
        assert self._merged is not None
        for full, m in self._merged.items():
            a = lora[f"{full}.lora_A.weight"].to(m.base.device, torch.float32)
            b = lora[f"{full}.lora_B.weight"].to(m.base.device, torch.float32)
            w = folded_weight(m.base.to(torch.float32), a, b, m.scale)
            m.layer.weight.copy_(w.to(m.layer.weight.dtype))
        self._merged_lora = {
            k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in lora.items()
        }

    # ------------------------------------------------------------------- FSDP
    def fsdp_wrap_units(self) -> list[type[nn.Module]]:
        """Module classes (from ``no_split_modules``) whose instances are FSDP2 wrap units.

        Every class named must occur in the trainable model (a typo would shard nothing)."""
        found: dict[str, type[nn.Module]] = {}
        for m in self.model.modules():
            # after FSDP2's fully_shard a block's class is a subclass named FSDP<Name>
            for klass in type(m).__mro__:
                if klass.__name__ in self.no_split_modules:
                    found.setdefault(klass.__name__, klass)
                    break
        missing = [n for n in self.no_split_modules if n not in found]
        if missing:
            raise ValueError(
                f"no_split_modules: {missing} not found in {type(self.model).__name__}"
            )
        return [found[n] for n in self.no_split_modules]

    def fsdp_wrap_modules(self) -> list[nn.Module]:
        """The module instances to pass to ``fully_shard`` one by one (then the root)."""
        units = tuple(self.fsdp_wrap_units())
        return [m for m in self.model.modules() if isinstance(m, units)]

    def mixed_precision_policy(self) -> dict[str, torch.dtype | None]:
        """FSDP2 mixed precision as dtypes: ``param_dtype`` (compute), ``reduce_dtype``
        (gradient all-reduce), ``output_dtype``."""
        return {k: None if v is None else resolve_dtype(v) for k, v in self.mixed_precision.items()}

    def fsdp_mixed_precision(self) -> Any:
        """``torch.distributed.fsdp.MixedPrecisionPolicy`` built from :meth:`mixed_precision_policy`."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(**self.mixed_precision_policy())

    # ------------------------------------------------------- rollout alignment
    def export_rollout_weights(
        self, fmt: str = "omni", *, adapter_name: str | None = None, gather: bool = True
    ) -> dict[str, torch.Tensor]:
        """The trainable weights as the rollout engine expects them: float32, contiguous, CPU.

        - ``fmt="omni"``: names relative to the trainable model, LoRA tensors without the
          adapter-name segment (``transformer_blocks.0.attn.to_q.lora_A.weight``); in full
          fine-tuning, every trainable parameter by name.
        - ``fmt="vllm_omni"`` (alias ``"peft"``): peft's saved-adapter layout, the same names
          with ``base_model.model.`` in front (pair with :meth:`lora_config`).

        Under FSDP2 the DTensor shards are all-gathered (every rank must call this); with
        ``gather=False`` they stay DTensors (detached, no collective) so that each rank can
        send its own piece (``DTensor.to_local()``) and the receiver puts them together.
        """
        if fmt not in ("omni", "vllm_omni", "peft"):
            raise ValueError(f"fmt: expected 'omni', 'vllm_omni' or 'peft', got {fmt!r}")
        if self._lora_configs:
            name = adapter_name or self._trainable_adapter or "default"
            tensors = self.adapter_state(name)
        elif self.train_mode == "full":
            tensors = self.named_trainable_parameters()
        else:
            raise ValueError("export_rollout_weights: nothing trains (add_lora or set_trainable)")
        prefix = "" if fmt == "omni" else self.vllm_omni_prefix
        # sorted: under FSDP2 each DTensor is all-gathered, a collective every rank runs in
        # the same order
        if not gather:
            return {prefix + self.checkpoint_name(k): tensors[k].detach() for k in sorted(tensors)}
        return {
            prefix + self.checkpoint_name(k): _full(tensors[k])
            .to(device="cpu", dtype=torch.float32)
            .contiguous()
            .clone()
            for k in sorted(tensors)
        }

    def checkpoint_name(self, name: str) -> str:
        """The name a parameter of the trainable model has in the family's released
        checkpoint. The identity here; a family whose transformers module tree differs from
        its checkpoint layout (it changes between transformers releases) overrides this and
        :meth:`module_name`, so exported weights keep one layout for the rollout engine."""
        return name

    def module_name(self, name: str) -> str:
        """The inverse of :meth:`checkpoint_name`."""
        return name

    def save_peft_adapter(
        self, path: str | os.PathLike[str], *, adapter_name: str | None = None
    ) -> Path:
        """Write a peft adapter folder (``adapter_model.safetensors`` with ``base_model.model.``
        names + ``adapter_config.json``): the format vllm-omni's LoRA loader reads from a
        ``LoRARequest`` path. Returns the folder."""
        from safetensors.torch import save_file

        name = adapter_name or self._trainable_adapter or "default"
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        tensors = self.export_rollout_weights("peft", adapter_name=name)
        save_file(tensors, str(root / "adapter_model.safetensors"))
        cfg = self.lora_config(name)
        (root / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        return root

    @torch.no_grad()
    def load_weights(
        self, tensors: dict[str, torch.Tensor], *, adapter_name: str | None = None
    ) -> None:
        """Rollout weight sync: copy exported tensors (either format) into this model.

        LoRA tensors go to ``adapter_name`` (default: the trainable adapter). Unknown names,
        missing names, shape mismatches, non-float dtypes and NaN/inf values are errors that
        name the tensor, raised before anything is copied (all or nothing). A merged rollout
        model (:meth:`merge_lora`) recomputes its merged weights from the LoRA tensors."""
        if self._lora_configs:
            name = adapter_name or self._trainable_adapter or "default"
            own = self.adapter_state(name)
        else:
            own = dict(self.model.named_parameters())
        incoming = {
            self.module_name(k.removeprefix(self.vllm_omni_prefix)): v for k, v in tensors.items()
        }
        unknown = sorted(set(incoming) - set(own))
        if unknown:
            raise ValueError(f"load_weights: unknown tensor names, e.g. {unknown[:3]}")
        if self._lora_configs:
            missing = sorted(set(own) - set(incoming))
            if missing:
                raise ValueError(f"load_weights: missing tensors, e.g. {missing[:3]}")
        # Every tensor is checked before any is copied: a rejected update changes nothing.
        for k in sorted(incoming):
            v, p = incoming[k], own[k]
            if tuple(p.shape) != tuple(v.shape):
                raise ValueError(f"load_weights: {k}: shape {tuple(v.shape)} != {tuple(p.shape)}")
            if not (v.is_floating_point() and bool(torch.isfinite(v).all())):
                raise ValueError(f"load_weights: {k}: not floating point, or holds NaN/inf")
        if self._merged is not None:
            self._merge_into(incoming)
            return
        for k in sorted(incoming):
            v, p = incoming[k], own[k]
            v = v.to(device=p.device, dtype=p.dtype)
            if hasattr(p, "device_mesh"):  # FSDP2 DTensor: keep this rank's shard
                from torch.distributed.tensor import distribute_tensor

                v = distribute_tensor(v, p.device_mesh, p.placements)
            p.copy_(v)

    @staticmethod
    def weights_checksum(tensors: dict[str, torch.Tensor]) -> str:
        """See :func:`omni_adapters.base.weights_checksum`."""
        return weights_checksum(tensors)
