"""``omni-rewards convert``: released torch-pickle checkpoints to safetensors, once.

Several reward models are published as torch pickles (``imagebind_huge.pth``, HPS v2.1's
``HPS_v2.1_compressed.pt``, the LAION aesthetic predictor's ``.pth``, DiNa-LRM's
``checkpoint/rm_head.pt``). Loading a pickle can run arbitrary code, so the rewards never
read one: these converters, run explicitly by the user, read it with
``torch.load(weights_only=True)`` (tensors and plain containers only) and write safetensors
that the rewards then load. Each conversion is strict: every tensor is either written or
dropped by a documented rule (ImageBind's depth / thermal / IMU towers), never silently.

    omni-rewards convert imagebind imagebind_huge.pth ~/models/imagebind_huge
    omni-rewards convert hpsv2 HPS_v2.1_compressed.pt ~/models/hps_v2.1.safetensors
    omni-rewards convert aesthetic sac+logos+ava1-l14-linearMSE.pth ~/models/aesthetic.safetensors
    omni-rewards convert dina-lrm ~/models/DiNa-LRM-SD35M-12layers
    omni-rewards convert state-dict any.pt any.safetensors
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .base import require_module

__all__ = [
    "CONVERTERS",
    "convert_aesthetic",
    "convert_dina_lrm",
    "convert_hpsv2",
    "convert_imagebind",
    "convert_state_dict",
    "read_torch_state_dict",
]


def read_torch_state_dict(path: str | Path) -> dict[str, Any]:
    """The tensors of a torch checkpoint, read with ``torch.load(weights_only=True)``; a
    ``{"state_dict": ...}`` wrapper and DataParallel's ``module.`` prefix are removed. Only the
    converters call this."""
    torch = require_module("torch", "imagebind", "convert")
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"src: no such file {path}")
    sd = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise ValueError(f"src: {path} holds a {type(sd).__name__}, not a state dict")
    out = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"src: {path}: entry {k!r} is a {type(v).__name__}, not a tensor")
        out[k.removeprefix("module.")] = v.contiguous()
    return out


def _save(tensors: dict[str, Any], dst: Path) -> Path:
    from safetensors.torch import save_file

    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst))
    return dst


def convert_state_dict(src: str | Path, dst: str | Path) -> Path:
    """Any torch state dict -> one ``.safetensors`` file with the same names."""
    return _save(read_torch_state_dict(src), Path(dst).expanduser())


def convert_hpsv2(src: str | Path, dst: str | Path) -> Path:
    """HPS v2 / v2.1 (``{"state_dict": open_clip ViT-H-14 weights}``) -> ``.safetensors``
    with open_clip's names (``visual.*``, ``transformer.*``, ``token_embedding.weight``,
    ``positional_embedding``, ``ln_final.*``, ``text_projection``, ``logit_scale``)."""
    sd = read_torch_state_dict(src)
    need = ("visual.proj", "token_embedding.weight", "text_projection", "logit_scale")
    missing = [k for k in need if k not in sd]
    if missing:
        raise ValueError(f"src: {src} is not an open_clip CLIP state dict (missing {missing})")
    return _save(sd, Path(dst).expanduser())


def convert_aesthetic(src: str | Path, dst: str | Path) -> Path:
    """The LAION aesthetic predictor's MLP (``layers.<i>.weight/bias``) -> ``.safetensors``."""
    sd = read_torch_state_dict(src)
    bad = sorted(k for k in sd if not k.startswith("layers."))
    if bad or not sd:
        raise ValueError(f"src: {src}: expected only 'layers.<i>.*' tensors, got {bad[:5]}")
    return _save(sd, Path(dst).expanduser())


def convert_imagebind(src: str | Path, dst: str | Path, config: str | Path | None = None) -> Path:
    """``imagebind_huge.pth`` (the whole ``ImageBindModel`` state dict of
    facebookresearch/ImageBind) -> ``dst/config.json`` + ``dst/model.safetensors`` with the
    vision, text and audio towers. The depth, thermal and IMU towers' tensors are dropped by
    name (``modality_*.{depth,thermal,imu}.*``); any other difference from the architecture
    (``config``: a JSON of `ImageBindConfig` fields, default the released huge model) is an
    error naming the tensors. Returns ``dst``."""
    from .imagebind import (
        IMAGEBIND_HUGE,
        UNUSED_MODALITIES,
        ImageBindConfig,
        build_imagebind,
        check_state,
        save_imagebind,
    )

    cfg = IMAGEBIND_HUGE
    if config is not None:
        cfg = ImageBindConfig.from_dict(json.loads(Path(config).expanduser().read_text()))
    sd = read_torch_state_dict(src)
    kept = {
        k: v for k, v in sd.items() if k.split(".")[1:2] not in [[m] for m in UNUSED_MODALITIES]
    }
    model = build_imagebind(cfg)
    check_state(model, kept, str(src))
    model.load_state_dict(kept, strict=True)
    return save_imagebind(model, Path(dst).expanduser())


def convert_dina_lrm(root: str | Path, dst: str | Path | None = None) -> Path:
    """A DiNa-LRM release folder (``config.json``, ``checkpoint/backbone_lora/`` (peft,
    safetensors), ``checkpoint/rm_head.pt``): writes ``checkpoint/rm_head.safetensors`` next
    to the pickle (or at ``dst``). Returns the written file."""
    root = Path(root).expanduser()
    head = root / "checkpoint" / "rm_head.pt"
    if not head.is_file():
        raise FileNotFoundError(f"src: {root} has no checkpoint/rm_head.pt (not a DiNa-LRM folder)")
    out = Path(dst).expanduser() if dst else root / "checkpoint" / "rm_head.safetensors"
    return _save(read_torch_state_dict(head), out)


#: kind -> (converter, help)
CONVERTERS: dict[str, tuple[Callable[..., Path], str]] = {
    "imagebind": (convert_imagebind, "imagebind_huge.pth -> a directory (config + safetensors)"),
    "hpsv2": (convert_hpsv2, "HPS_v2(.1)_compressed.pt -> .safetensors"),
    "aesthetic": (convert_aesthetic, "LAION aesthetic predictor .pth -> .safetensors"),
    "dina-lrm": (convert_dina_lrm, "DiNa-LRM folder: checkpoint/rm_head.pt -> rm_head.safetensors"),
    "state-dict": (convert_state_dict, "any torch state dict -> .safetensors"),
}
