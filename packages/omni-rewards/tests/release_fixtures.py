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


# ----------------------------------------------------------------------------- DiNa-LRM
def dina_lrm_lora_shapes(
    *, layers: int, dim: int, rank: int, dual: tuple[int, ...] = (0,)
) -> dict[str, tuple[int, ...]]:
    """``checkpoint/backbone_lora/adapter_model.safetensors``: peft's saved names
    (``base_model.model.<module>.lora_A/B.weight``) for the official target list (to_q, to_k,
    to_v, to_out.0, add_q_proj, add_k_proj, add_v_proj, to_add_out; HKUST-C4G/diffusion-rm
    ``sd3_rm.py``) on the first ``layers`` SD3 joint blocks; blocks in ``dual`` also have the
    SD3.5 ``attn2`` (to_q/k/v, to_out.0)."""
    s: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        mods = [f"attn.{n}" for n in ("to_q", "to_k", "to_v", "to_out.0")]
        mods += [f"attn.{n}" for n in ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")]
        if i in dual:
            mods += [f"attn2.{n}" for n in ("to_q", "to_k", "to_v", "to_out.0")]
        for m in mods:
            pre = f"base_model.model.transformer_blocks.{i}.{m}"
            s[pre + ".lora_A.weight"] = (rank, dim)
            s[pre + ".lora_B.weight"] = (dim, rank)
    return s


def dina_lrm_head_shapes(
    *, dim: int, n_visual: int, n_text: int, queries: int = 4
) -> dict[str, tuple[int, ...]]:
    """``checkpoint/rm_head.pt``: ``RewardHead.state_dict()`` names of HKUST-C4G/diffusion-rm
    ``reward_head.py`` (width = token dim, no proj_in, FiLM adapters, two gated cross-attention
    blocks, FFN, linear head)."""
    feat = dim // 4
    s: dict[str, tuple[int, ...]] = {}
    for kind, n in (("visual", n_visual), ("text", n_text)):
        for i in range(n):
            p = f"layer_adapters_{kind}.{i}."
            s[p + "layer_embed"] = (1, 1, dim)
            s[p + "cond_mlp.0.weight"] = (2 * dim, dim)
            s[p + "cond_mlp.0.bias"] = (2 * dim,)
            s[p + "cond_mlp.2.weight"] = (2 * dim, 2 * dim)
            s[p + "cond_mlp.2.bias"] = (2 * dim,)
            s[p + "proj.weight"] = (feat, dim)
            s[p + "proj.bias"] = (feat,)
    s["agg_visual.weight"], s["agg_visual.bias"] = (dim, n_visual * feat), (dim,)
    s["agg_text.weight"], s["agg_text.bias"] = (dim, n_text * feat), (dim,)
    s["query_tokens"] = (1, queries, dim)
    for blk, text in (("attn1", True), ("attn2", False)):
        norms = ["norm_q", "norm_v"] + (["norm_t"] if text else [])
        for n in norms:
            s[f"{blk}.{n}.weight"] = (dim,)
        lins = ["to_q", "to_k_vis", "to_v_vis", "to_out.0"]
        lins += ["to_k_text", "to_v_text"] if text else []
        for n in lins:
            s[f"{blk}.{n}.weight"], s[f"{blk}.{n}.bias"] = (dim, dim), (dim,)
        if blk == "attn1":  # value gates (use_v_gating) only in attn1
            for g in ("gate_vis", "gate_text"):
                s[f"{blk}.{g}.0.weight"], s[f"{blk}.{g}.0.bias"] = (dim, dim), (dim,)
                s[f"{blk}.{g}.2.weight"], s[f"{blk}.{g}.2.bias"] = (1, dim), (1,)
    s["norm_ff.weight"] = (dim,)
    s["ff.0.weight"], s["ff.0.bias"] = (4 * dim, dim), (4 * dim,)
    s["ff.2.weight"], s["ff.2.bias"] = (dim, 4 * dim), (dim,)
    s["head.weight"], s["head.bias"] = (1, dim), (1,)
    return s


def write_dina_lrm_release(
    root,
    backbone: str,
    *,
    layers: int = 2,
    dim: int = 32,
    rank: int = 4,
    seed: int = 0,
    head: dict | None = None,
    lora: dict | None = None,
):
    """The DiNa-LRM release layout at tiny size: ``config.json`` (the official config keys,
    ``backbone_model_id`` pointing at ``backbone``), ``checkpoint/backbone_lora/``
    (``adapter_config.json`` + ``adapter_model.safetensors``) and ``checkpoint/rm_head.pt``
    (a torch pickle, as released). Returns the tensors written."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    root = Path(root)
    ck = root / "checkpoint"
    (ck / "backbone_lora").mkdir(parents=True, exist_ok=True)
    idx = list(range(1, layers + 1))
    config = {
        "model": {
            "model_type": "thurstone",
            "backbone_model_id": str(backbone),
            "num_transformer_layers": layers,
            "freeze_backbone": False,
            "use_ema": True,
            "ema_decay": 0.995,
            "use_lora": True,
            "use_text_features": True,
            "lora_config": {"r": rank, "lora_alpha": 2 * rank, "init_lora_weights": "gaussian"},
            "use_logistic": False,
            "visual_head_idx": idx,
            "text_head_idx": idx,
            "use_t_embed": True,
            "reward_head": {
                "use_proj_in": False,
                "width": -1,
                "out_dim": 1,
                "num_queries": 4,
                "num_attn_heads": 4,
                "dropout": 0.0,
            },
        },
        "training": {"mixed_precision": "bf16", "add_noise": True},
    }
    (root / "config.json").write_text(json.dumps(config, indent=2))
    targets = [
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    ]
    (ck / "backbone_lora" / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": None,
                "base_model_name_or_path": None,
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "target_modules": targets,
                "exclude_modules": None,
                "init_lora_weights": "gaussian",
                "bias": "none",
                "fan_in_fan_out": False,
                "use_dora": False,
                "use_rslora": False,
            },
            indent=2,
        )
    )
    g = torch.Generator().manual_seed(seed)
    if lora is None:
        lora = {
            k: torch.randn(s, generator=g) * 0.1
            for k, s in dina_lrm_lora_shapes(layers=layers, dim=dim, rank=rank).items()
        }
    if head is None:
        head = {}
        for k, s in dina_lrm_head_shapes(dim=dim, n_visual=layers, n_text=layers).items():
            v = torch.randn(s, generator=g) * 0.2
            head[k] = 1.0 + v if "norm" in k else v
    save_file(lora, str(ck / "backbone_lora" / "adapter_model.safetensors"))
    torch.save(head, str(ck / "rm_head.pt"))
    return {"lora": lora, "head": head}
