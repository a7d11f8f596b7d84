"""Checkpoints written in released layouts from the official code's names (independent of
omni_rewards' own builders and loaders)."""

from __future__ import annotations

import torch


def imagebind_release_shapes(
    *,
    vision=(32, 1),  # (width, blocks)
    text=(32, 1),
    audio=(32, 1),
    embed=16,
    image=32,
    patch=8,
    vocab=300,
    ctx=16,
    mel=32,
    frames=204,
) -> dict[str, tuple[int, ...]]:
    """Names and shapes of ``imagebind_huge.pth`` (``ImageBindModel.state_dict()``), from
    facebookresearch/ImageBind ``imagebind/models/imagebind_model.py``,
    ``multimodal_preprocessors.py``, ``transformer.py`` and ``helpers.py``: all six
    modalities (depth / thermal / IMU with a few representative tensors)."""
    s: dict[str, tuple[int, ...]] = {}

    def trunk(m: str, w: int, blocks: int, pre_ln: bool, bias_kv: bool) -> None:
        if pre_ln:  # nn.Sequential(LayerNorm, EinOpsRearrange)
            s[f"modality_trunks.{m}.pre_transformer_layer.0.weight"] = (w,)
            s[f"modality_trunks.{m}.pre_transformer_layer.0.bias"] = (w,)
        for i in range(blocks):
            b = f"modality_trunks.{m}.blocks.{i}."
            s[b + "attn.in_proj_weight"] = (3 * w, w)
            s[b + "attn.in_proj_bias"] = (3 * w,)
            s[b + "attn.out_proj.weight"] = (w, w)
            s[b + "attn.out_proj.bias"] = (w,)
            if bias_kv:
                s[b + "attn.bias_k"] = (1, 1, w)
                s[b + "attn.bias_v"] = (1, 1, w)
            for n in ("norm_1", "norm_2"):
                s[b + n + ".weight"] = (w,)
                s[b + n + ".bias"] = (w,)
            s[b + "mlp.fc1.weight"] = (4 * w, w)
            s[b + "mlp.fc1.bias"] = (4 * w,)
            s[b + "mlp.fc2.weight"] = (w, 4 * w)
            s[b + "mlp.fc2.bias"] = (w,)

    v, vb = vision
    s["modality_preprocessors.vision.cls_token"] = (1, 1, v)
    # PatchEmbedGeneric([PadIm2Video, Conv3d]) -> proj is a Sequential: proj.1 is the conv
    s["modality_preprocessors.vision.rgbt_stem.proj.1.weight"] = (v, 3, 2, patch, patch)
    n = (image // patch) ** 2
    s["modality_preprocessors.vision.pos_embedding_helper.pos_embed"] = (1, n + 1, v)
    trunk("vision", v, vb, True, False)
    s["modality_heads.vision.0.weight"] = (v,)
    s["modality_heads.vision.0.bias"] = (v,)
    s["modality_heads.vision.2.weight"] = (embed, v)

    t, tb = text
    s["modality_preprocessors.text.token_embedding.weight"] = (vocab, t)
    s["modality_preprocessors.text.pos_embed"] = (1, ctx, t)
    s["modality_preprocessors.text.mask"] = (ctx, ctx)  # a persistent buffer
    trunk("text", t, tb, False, False)
    s["modality_heads.text.proj.0.weight"] = (t,)
    s["modality_heads.text.proj.0.bias"] = (t,)
    s["modality_heads.text.proj.1.weight"] = (embed, t)
    s["modality_postprocessors.text.1.log_logit_scale"] = ()  # scalar parameter

    a, ab = audio
    s["modality_preprocessors.audio.cls_token"] = (1, 1, a)
    # PatchEmbedGeneric([Conv2d], norm_layer=...) -> a one-layer stem is the conv itself
    s["modality_preprocessors.audio.rgbt_stem.proj.weight"] = (a, 1, 16, 16)
    s["modality_preprocessors.audio.rgbt_stem.norm_layer.weight"] = (a,)
    s["modality_preprocessors.audio.rgbt_stem.norm_layer.bias"] = (a,)
    h, w = (mel - 16) // 10 + 1, (frames - 16) // 10 + 1
    s["modality_preprocessors.audio.pos_embedding_helper.pos_embed"] = (1, h * w + 1, a)
    trunk("audio", a, ab, False, True)
    s["modality_heads.audio.0.weight"] = (a,)
    s["modality_heads.audio.0.bias"] = (a,)
    s["modality_heads.audio.2.weight"] = (embed, a)
    s["modality_postprocessors.audio.1.log_logit_scale"] = ()  # scalar buffer

    for m, w in (("depth", 8), ("thermal", 8), ("imu", 8)):  # the towers the reward drops
        s[f"modality_preprocessors.{m}.cls_token"] = (1, 1, w)
        s[f"modality_trunks.{m}.blocks.0.attn.in_proj_weight"] = (3 * w, w)
        s[f"modality_heads.{m}.0.weight"] = (w,)
        s[f"modality_postprocessors.{m}.1.log_logit_scale"] = ()
    return s


def imagebind_release_state(seed: int = 0, **sizes) -> dict[str, torch.Tensor]:
    """Random tensors in the released names/shapes (the causal text mask and the logit
    scales as the official code initialises them)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, shape in imagebind_release_shapes(**sizes).items():
        if k.endswith("text.mask"):
            out[k] = torch.full(shape, float("-inf")).triu(1)
        elif k.endswith("log_logit_scale"):
            out[k] = torch.tensor(2.0 + torch.rand((), generator=g).item())
        else:
            out[k] = torch.randn(shape, generator=g) * 0.2
    return out
