"""The FLUX autoencoder checkpoint (``ae.safetensors``, Black Forest Labs' layout, which BAGEL
ships) read into a diffusers ``AutoencoderKL``.

The released file holds the original module tree of ``flux/modules/autoencoder.py`` (also
``modeling/autoencoder.py`` in ByteDance-Seed/Bagel): ``encoder.down.<i>.block.<j>.*``,
``encoder.down.<i>.downsample.conv``, ``{encoder,decoder}.mid.{block_1,attn_1,block_2}``,
``decoder.up.<i>.block.<j>.*`` (``up.0`` is the highest resolution), ``norm_out``,
``conv_out``; attention projections ``q, k, v, proj_out`` are 1x1 convolutions. There is no
config file: the architecture is read from the tensor shapes, and the latent scale and shift
are the constants the official ``load_ae`` hard-codes (0.3611, 0.1159); GroupNorm uses 32
groups there too. :func:`to_diffusers_name` is the one-to-one renaming (an unknown name is an
error), :func:`autoencoder_config` the matching ``AutoencoderKL`` config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "FLUX_AE_RELEASED",
    "FLUX_SCALE",
    "FLUX_SHIFT",
    "autoencoder_config",
    "from_diffusers_state",
    "released_config",
    "to_diffusers_name",
    "to_diffusers_state",
]

#: latent scale / shift of the FLUX autoencoder (official ``load_ae``)
FLUX_SCALE = 0.3611
FLUX_SHIFT = 0.1159

#: the released autoencoder (``AutoEncoderParams`` in the official ``load_ae``)
FLUX_AE_RELEASED = {"ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "z_channels": 16}

_ATTN = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def _resnet(rest: str) -> str:
    return rest.replace("nin_shortcut", "conv_shortcut")


def to_diffusers_name(name: str, levels: int) -> str:
    """The ``AutoencoderKL`` parameter name of a released FLUX autoencoder tensor name
    (``levels`` resolution levels); ``KeyError`` for a name outside the released tree."""
    m = re.fullmatch(r"(encoder|decoder)\.(conv_in|conv_out|norm_out)\.(weight|bias)", name)
    if m:
        part = "conv_norm_out" if m[2] == "norm_out" else m[2]
        return f"{m[1]}.{part}.{m[3]}"
    m = re.fullmatch(r"(encoder|decoder)\.mid\.block_([12])\.(.+)", name)
    if m:
        return f"{m[1]}.mid_block.resnets.{int(m[2]) - 1}.{_resnet(m[3])}"
    m = re.fullmatch(r"(encoder|decoder)\.mid\.attn_1\.(norm|q|k|v|proj_out)\.(weight|bias)", name)
    if m:
        return f"{m[1]}.mid_block.attentions.0.{_ATTN[m[2]]}.{m[3]}"
    m = re.fullmatch(r"encoder\.down\.(\d+)\.block\.(\d+)\.(.+)", name)
    if m:
        return f"encoder.down_blocks.{m[1]}.resnets.{m[2]}.{_resnet(m[3])}"
    m = re.fullmatch(r"encoder\.down\.(\d+)\.downsample\.conv\.(weight|bias)", name)
    if m:
        return f"encoder.down_blocks.{m[1]}.downsamplers.0.conv.{m[2]}"
    m = re.fullmatch(r"decoder\.up\.(\d+)\.block\.(\d+)\.(.+)", name)
    if m:
        return f"decoder.up_blocks.{levels - 1 - int(m[1])}.resnets.{m[2]}.{_resnet(m[3])}"
    m = re.fullmatch(r"decoder\.up\.(\d+)\.upsample\.conv\.(weight|bias)", name)
    if m:
        return f"decoder.up_blocks.{levels - 1 - int(m[1])}.upsamplers.0.conv.{m[2]}"
    raise KeyError(name)


def _levels(names: Any) -> int:
    idx = {int(m[1]) for k in names if (m := re.match(r"encoder\.down\.(\d+)\.", k))}
    if not idx:
        raise ValueError("ae.safetensors: no encoder.down.<i> tensors (not a FLUX autoencoder)")
    return max(idx) + 1


def autoencoder_config(shapes: Mapping[str, Any]) -> dict[str, Any]:
    """``AutoencoderKL`` keyword arguments for a FLUX autoencoder with these tensor shapes
    (name -> shape)."""
    need = ("encoder.conv_in.weight", "encoder.conv_out.weight", "decoder.conv_out.weight")
    missing = [k for k in need if k not in shapes]
    if missing:
        raise ValueError(f"ae.safetensors: missing {missing} (not a FLUX autoencoder)")
    levels = _levels(shapes)
    blocks = {int(m[1]) for k in shapes if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k))}
    channels = [int(shapes[f"encoder.down.{i}.block.0.conv2.weight"][0]) for i in range(levels)]
    return {
        "in_channels": int(shapes["encoder.conv_in.weight"][1]),
        "out_channels": int(shapes["decoder.conv_out.weight"][0]),
        "down_block_types": ("DownEncoderBlock2D",) * levels,
        "up_block_types": ("UpDecoderBlock2D",) * levels,
        "block_out_channels": tuple(channels),
        "layers_per_block": len(blocks),
        "latent_channels": int(shapes["encoder.conv_out.weight"][0]) // 2,
        "norm_num_groups": 32,
        "scaling_factor": FLUX_SCALE,
        "shift_factor": FLUX_SHIFT,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
    }


def released_config() -> dict[str, Any]:
    """The ``AutoencoderKL`` config of the released FLUX autoencoder (for meta builds)."""
    ch, mult = FLUX_AE_RELEASED["ch"], FLUX_AE_RELEASED["ch_mult"]
    levels = len(mult)
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ("DownEncoderBlock2D",) * levels,
        "up_block_types": ("UpDecoderBlock2D",) * levels,
        "block_out_channels": tuple(ch * m for m in mult),
        "layers_per_block": FLUX_AE_RELEASED["num_res_blocks"],
        "latent_channels": FLUX_AE_RELEASED["z_channels"],
        "norm_num_groups": 32,
        "scaling_factor": FLUX_SCALE,
        "shift_factor": FLUX_SHIFT,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
    }


def to_diffusers_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Released tensors renamed for ``AutoencoderKL`` (1x1 attention convs become linear
    weights). An unknown name is a ``ValueError`` naming it."""
    levels = _levels(state)
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for k, v in state.items():
        try:
            new = to_diffusers_name(k, levels)
        except KeyError:
            unknown.append(k)
            continue
        if ".attentions.0.to_" in new and new.endswith(".weight") and v.dim() == 4:
            v = v[:, :, 0, 0]
        out[new] = v
    if unknown:
        raise ValueError(f"ae.safetensors: unexpected tensors {sorted(unknown)[:12]}")
    return out


def from_diffusers_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_diffusers_state`: ``AutoencoderKL`` tensors in the released
    layout (used to write tiny checkpoints in that layout)."""
    levels = len({int(m[1]) for k in state if (m := re.match(r"encoder\.down_blocks\.(\d+)", k))})
    blocks = 1 + max(int(m[1]) for k in state if (m := re.search(r"\.resnets\.(\d+)\.", k)))
    flux_names: dict[str, str] = {}
    for i in range(levels):
        for j in range(blocks):
            for part in ("norm1", "conv1", "norm2", "conv2", "nin_shortcut"):
                for w in ("weight", "bias"):
                    flux_names[
                        to_diffusers_name(f"encoder.down.{i}.block.{j}.{part}.{w}", levels)
                    ] = f"encoder.down.{i}.block.{j}.{part}.{w}"
                    flux_names[
                        to_diffusers_name(f"decoder.up.{i}.block.{j}.{part}.{w}", levels)
                    ] = f"decoder.up.{i}.block.{j}.{part}.{w}"
        for w in ("weight", "bias"):
            flux_names[to_diffusers_name(f"encoder.down.{i}.downsample.conv.{w}", levels)] = (
                f"encoder.down.{i}.downsample.conv.{w}"
            )
            flux_names[to_diffusers_name(f"decoder.up.{i}.upsample.conv.{w}", levels)] = (
                f"decoder.up.{i}.upsample.conv.{w}"
            )
    for side in ("encoder", "decoder"):
        for w in ("weight", "bias"):
            for part in ("conv_in", "conv_out", "norm_out"):
                flux_names[to_diffusers_name(f"{side}.{part}.{w}", levels)] = f"{side}.{part}.{w}"
            for blk in ("block_1", "block_2"):
                for part in ("norm1", "conv1", "norm2", "conv2", "nin_shortcut"):
                    k = f"{side}.mid.{blk}.{part}.{w}"
                    flux_names[to_diffusers_name(k, levels)] = k
            for part in _ATTN:
                k = f"{side}.mid.attn_1.{part}.{w}"
                flux_names[to_diffusers_name(k, levels)] = k
    out = {}
    for k, v in state.items():
        if k not in flux_names:
            raise ValueError(f"AutoencoderKL: tensor {k} has no FLUX name")
        name = flux_names[k]
        if ".attn_1." in name and name.endswith(".weight") and not name.endswith("norm.weight"):
            v = v[:, :, None, None]
        out[name] = v
    return out
