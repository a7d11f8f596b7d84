"""Tiny checkpoints written in released layouts, from the official code's names.

Nothing here calls omni_adapters' builders or loaders: the file names, config keys and
tensor names/shapes are spelled out from the official sources (cited per writer), so a
loader that drifts from the release fails these fixtures even if it still reads what our own
tiny builders write.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# ----------------------------------------------------------------------------- BAGEL
#: sizes of the tiny BAGEL fixture (the release: hidden 3584, 28 layers, 28/4 heads, SigLIP
#: so400m 1152 x 27 layers, patch 14 at 980 px, latent patch 2, max latent 64, ViT grid 70)
BAGEL_TINY = {
    "hidden": 32,
    "inter": 48,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 320,
    "vit_hidden": 16,
    "vit_inter": 24,
    "vit_layers_in_config": 3,  # the official loader drops one: 2 layers in ema.safetensors
    "vit_heads": 2,
    "vit_patch": 4,
    "vit_image": 16,
    "vit_grid": 4,
    "latent_patch": 2,
    "latent_grid": 8,
    "z": 4,
    "ae_ch": 32,
    "ae_mult": (1, 1),
    "ae_blocks": 1,
}


def bagel_ema_shapes(t: dict = BAGEL_TINY) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of ``ema.safetensors`` (``Bagel.state_dict()`` after
    ``convert_conv2d_to_linear``), from ByteDance-Seed/Bagel ``modeling/bagel/bagel.py``,
    ``qwen2_navit.py`` (``Qwen2MoTDecoderLayer``, ``PackedAttentionMoT``),
    ``siglip_navit.py`` and ``modeling_utils.py``."""
    h, hd = t["hidden"], t["hidden"] // t["heads"]
    kv = t["kv_heads"] * hd
    s: dict[str, tuple[int, ...]] = {
        "language_model.model.embed_tokens.weight": (t["vocab"], h),
        "language_model.model.norm.weight": (h,),
        "language_model.model.norm_moe_gen.weight": (h,),
        "language_model.lm_head.weight": (t["vocab"], h),
    }
    for i in range(t["layers"]):
        pre = f"language_model.model.layers.{i}."
        for e in ("", "_moe_gen"):
            s[f"{pre}self_attn.q_proj{e}.weight"] = (h, h)
            s[f"{pre}self_attn.q_proj{e}.bias"] = (h,)
            for n in ("k_proj", "v_proj"):
                s[f"{pre}self_attn.{n}{e}.weight"] = (kv, h)
                s[f"{pre}self_attn.{n}{e}.bias"] = (kv,)
            s[f"{pre}self_attn.o_proj{e}.weight"] = (h, h)
            s[f"{pre}self_attn.q_norm{e}.weight"] = (hd,)
            s[f"{pre}self_attn.k_norm{e}.weight"] = (hd,)
            s[f"{pre}mlp{e}.gate_proj.weight"] = (t["inter"], h)
            s[f"{pre}mlp{e}.up_proj.weight"] = (t["inter"], h)
            s[f"{pre}mlp{e}.down_proj.weight"] = (h, t["inter"])
            s[f"{pre}input_layernorm{e}.weight"] = (h,)
            s[f"{pre}post_attention_layernorm{e}.weight"] = (h,)
    pz = t["latent_patch"] ** 2 * t["z"]
    s.update(
        {
            "time_embedder.mlp.0.weight": (h, 256),
            "time_embedder.mlp.0.bias": (h,),
            "time_embedder.mlp.2.weight": (h, h),
            "time_embedder.mlp.2.bias": (h,),
            "vae2llm.weight": (h, pz),
            "vae2llm.bias": (h,),
            "llm2vae.weight": (pz, h),
            "llm2vae.bias": (pz,),
            "latent_pos_embed.pos_embed": (t["latent_grid"] ** 2, h),
            "connector.fc1.weight": (h, t["vit_hidden"]),
            "connector.fc1.bias": (h,),
            "connector.fc2.weight": (h, h),
            "connector.fc2.bias": (h,),
            "vit_pos_embed.pos_embed": (t["vit_grid"] ** 2, h),
        }
    )
    vh, p = t["vit_hidden"], t["vit_patch"]
    vm = "vit_model.vision_model."
    s[vm + "embeddings.patch_embedding.weight"] = (vh, 3 * p * p)  # linear after conversion
    s[vm + "embeddings.patch_embedding.bias"] = (vh,)
    s[vm + "embeddings.position_embedding.weight"] = ((t["vit_image"] // p) ** 2, vh)
    for j in range(t["vit_layers_in_config"] - 1):
        pre = f"{vm}encoder.layers.{j}."
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            s[f"{pre}self_attn.{n}.weight"] = (vh, vh)
            s[f"{pre}self_attn.{n}.bias"] = (vh,)
        for n in ("layer_norm1", "layer_norm2"):
            s[f"{pre}{n}.weight"] = (vh,)
            s[f"{pre}{n}.bias"] = (vh,)
        s[f"{pre}mlp.fc1.weight"] = (t["vit_inter"], vh)
        s[f"{pre}mlp.fc1.bias"] = (t["vit_inter"],)
        s[f"{pre}mlp.fc2.weight"] = (vh, t["vit_inter"])
        s[f"{pre}mlp.fc2.bias"] = (vh,)
    s[vm + "post_layernorm.weight"] = (vh,)
    s[vm + "post_layernorm.bias"] = (vh,)
    return s


def flux_ae_shapes(t: dict = BAGEL_TINY) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of ``ae.safetensors`` (FLUX ``AutoEncoder.state_dict()``),
    from ByteDance-Seed/Bagel ``modeling/autoencoder.py`` (black-forest-labs/flux's)."""
    ch, mult, nb, z = t["ae_ch"], t["ae_mult"], t["ae_blocks"], t["z"]
    s: dict[str, tuple[int, ...]] = {}

    def conv(name: str, cout: int, cin: int, k: int) -> None:
        s[name + ".weight"] = (cout, cin, k, k)
        s[name + ".bias"] = (cout,)

    def norm(name: str, c: int) -> None:
        s[name + ".weight"] = (c,)
        s[name + ".bias"] = (c,)

    def resnet(name: str, cin: int, cout: int) -> None:
        norm(name + ".norm1", cin)
        conv(name + ".conv1", cout, cin, 3)
        norm(name + ".norm2", cout)
        conv(name + ".conv2", cout, cout, 3)
        if cin != cout:
            conv(name + ".nin_shortcut", cout, cin, 1)

    def mid(side: str, c: int) -> None:
        resnet(f"{side}.mid.block_1", c, c)
        norm(f"{side}.mid.attn_1.norm", c)
        for n in ("q", "k", "v", "proj_out"):
            conv(f"{side}.mid.attn_1.{n}", c, c, 1)
        resnet(f"{side}.mid.block_2", c, c)

    levels = len(mult)
    conv("encoder.conv_in", ch, 3, 3)
    cin_mult = (1, *mult)
    for i in range(levels):
        cin, cout = ch * cin_mult[i], ch * mult[i]
        for j in range(nb):
            resnet(f"encoder.down.{i}.block.{j}", cin if j == 0 else cout, cout)
        if i != levels - 1:
            conv(f"encoder.down.{i}.downsample.conv", cout, cout, 3)
    c_last = ch * mult[-1]
    mid("encoder", c_last)
    norm("encoder.norm_out", c_last)
    conv("encoder.conv_out", 2 * z, c_last, 3)
    conv("decoder.conv_in", c_last, z, 3)
    mid("decoder", c_last)
    cin = c_last
    for i in reversed(range(levels)):
        cout = ch * mult[i]
        for j in range(nb + 1):
            resnet(f"decoder.up.{i}.block.{j}", cin if j == 0 else cout, cout)
        cin = cout
        if i != 0:
            conv(f"decoder.up.{i}.upsample.conv", cout, cout, 3)
    norm("decoder.norm_out", ch * mult[0])
    conv("decoder.conv_out", 3, ch * mult[0], 3)
    return s


def _random(shapes: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in sorted(shapes):
        v = torch.randn(shapes[k], generator=g) * 0.05
        if k.endswith(("norm.weight", "norm1.weight", "norm2.weight", "layernorm.weight")) or (
            "_norm" in k and k.endswith(".weight")
        ):
            v = 1.0 + v
        out[k] = v.to(dtype).contiguous()
    return out


def write_bagel_release(
    root: Path, seed: int = 0, *, ema: dict | None = None, ae: dict | None = None
) -> dict[str, dict]:
    """The BAGEL-7B-MoT folder layout at tiny size: ``llm_config.json`` (Qwen2 config),
    ``vit_config.json`` (SigLIP config), ``ema.safetensors`` (bfloat16, as released),
    ``ae.safetensors`` (float32), Qwen2 tokenizer files at the root. Returns the tensors
    written (``ema``/``ae`` override them, e.g. with a renamed key)."""
    from omni_adapters.tokenizers_tiny import qwen2_tokenizer

    t = BAGEL_TINY
    root.mkdir(parents=True, exist_ok=True)
    llm = {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": t["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": t["inter"],
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": t["heads"],
        "num_hidden_layers": t["layers"],
        "num_key_value_heads": t["kv_heads"],
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": t["vocab"],
    }
    vit = {
        "hidden_size": t["vit_hidden"],
        "image_size": t["vit_image"],
        "intermediate_size": t["vit_inter"],
        "model_type": "siglip_vision_model",
        "num_attention_heads": t["vit_heads"],
        "num_hidden_layers": t["vit_layers_in_config"],
        "patch_size": t["vit_patch"],
    }
    (root / "llm_config.json").write_text(json.dumps(llm, indent=2))
    (root / "vit_config.json").write_text(json.dumps(vit, indent=2))
    ema = ema if ema is not None else _random(bagel_ema_shapes(), seed, torch.bfloat16)
    ae = ae if ae is not None else _random(flux_ae_shapes(), seed + 1, torch.float32)
    save_file(ema, str(root / "ema.safetensors"))
    save_file(ae, str(root / "ae.safetensors"))
    qwen2_tokenizer(max_length=64).save_pretrained(root)
    return {"ema": ema, "ae": ae}
