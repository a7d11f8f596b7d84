"""BAGEL (Deng et al. 2025, "Emerging Properties in Unified Multimodal Pretraining"): one
decoder-only transformer for understanding and generation. There is no diffusers or
transformers class, so this module defines the model itself, with the module tree (and so
the parameter names) of the official ``modeling/bagel`` code (ByteDance-Seed/Bagel), and
reads the released checkpoint folder as the official ``app.py`` / ``inferencer.py`` do.

Released layout (``ByteDance-Seed/BAGEL-7B-MoT``), read as is:

- ``llm_config.json``: a transformers Qwen2 config (Qwen2.5-7B sizes); the official code
  then sets ``qk_norm=True``, ``tie_word_embeddings=False``, ``layer_module=
  "Qwen2MoTDecoderLayer"``;
- ``vit_config.json``: a SigLIP vision config (so400m, 27 layers, 980 px, patch 14); the
  official code drops the last layer (``num_hidden_layers -= 1``) and uses no 2-D RoPE;
- ``ema.safetensors``: the whole ``Bagel`` state dict (``language_model.model.layers.<i>.*``
  with both experts, ``language_model.lm_head``, ``time_embedder.mlp.{0,2}``,
  ``vae2llm``, ``llm2vae``, ``latent_pos_embed.pos_embed``, ``vit_model.vision_model.*`` with
  the patch embedding stored as a linear layer, ``connector.fc1/fc2``,
  ``vit_pos_embed.pos_embed``), loaded strictly (:mod:`omni_adapters.checkpoints`);
- ``ae.safetensors``: the FLUX autoencoder in Black Forest Labs' layout
  (:mod:`omni_adapters.flux_ae` renames it into a diffusers ``AutoencoderKL``);
- the Qwen2 tokenizer files at the root (``<|im_start|>``, ``<|im_end|>``,
  ``<|vision_start|>``, ``<|vision_end|>`` must be in its vocabulary).

The constants the official code passes to ``BagelConfig`` (``latent_patch_size=2``,
``max_latent_size=64``, ``vit_max_num_patch_per_side=70``) are not in any file: they are
read back from the tensor shapes (``vae2llm``, ``latent_pos_embed``, ``vit_pos_embed``), and
are the released values on the meta device.

Covered
- ``language_model``: a Qwen2 decoder (RMSNorm, RoPE, GQA, QK-norm, SwiGLU) turned into a
  *Mixture-of-Transformers*: every layer holds two experts with identical shapes, the
  understanding expert (``q_proj ... post_attention_layernorm``) and the generation expert
  (the same names with ``_moe_gen``); text tokens and the image start/end markers use the
  first, VAE-latent tokens the second, and one self-attention runs over the whole sequence.
- generation (text to image, rectified flow), as ``Bagel.prepare_prompts`` /
  ``prepare_vae_latent`` / ``_forward_flow`` lay it out: the prompt is
  ``<|im_start|> prompt <|im_end|>`` (causal), then ``<|vision_start|> latents
  <|vision_end|>`` at one shared RoPE position, bidirectional within itself; latents are
  patchified ``p x p`` (``(h, w, p, q, c)`` order), projected by ``vae2llm``, plus
  ``time_embedder(t)`` and ``latent_pos_embed`` (row * max_latent_size + column);
  ``llm2vae`` maps the generation expert's output back: the velocity ``v = eps - x0`` for
  ``x_t = (1 - t) x0 + t eps``. Timesteps shifted ``t' = s t / (1 + (s - 1) t)``,
  ``timestep_shift`` 3 (the released inference default). Text CFG's unconditional branch is
  the empty context (an empty negative prompt gives no text tokens), as in the inferencer.
- understanding: the SigLIP tower over ``p x p`` pixel patches (linear patch embedding +
  learned position embedding at row * 70 + column), ``connector``, ``vit_pos_embed``; image
  tokens between the vision start/end markers, bidirectional among themselves.

Not covered: NaViT packing of several images of native resolution in one sequence (one
fixed-size image per row here), the KV-cache inference path (every velocity call re-runs the
prompt; exact, just slower), image editing / interleaved conditioning, CFG renormalisation
and image CFG (plain text CFG only), the "thinking" text mode.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .. import flux_ae
from ..base import register_adapter, write_adapter_options
from ..checkpoints import load_state_strict, read_safetensors
from ..diffusion import DiffusionAdapter
from ..tiny import register_tiny

__all__ = [
    "BAGEL_LORA_TARGETS",
    "RELEASED_CONSTANTS",
    "Bagel",
    "BagelAdapter",
    "BagelConfig",
    "BagelMoTDecoderLayer",
    "build_tiny",
]

FAMILY = "bagel"
ARCHITECTURE = "Bagel"

#: default LoRA targets: the generation expert's attention projections
BAGEL_LORA_TARGETS = ("q_proj_moe_gen", "k_proj_moe_gen", "v_proj_moe_gen", "o_proj_moe_gen")

#: what the official app.py / inferencer pass to BagelConfig for BAGEL-7B-MoT
RELEASED_CONSTANTS = {
    "latent_patch_size": 2,
    "max_latent_size": 64,
    "vit_max_num_patch_per_side": 70,
}

#: special tokens of the released prompt layout
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")


# ------------------------------------------------------------------- config
@dataclass
class BagelConfig:
    """BAGEL hyper-parameters: the Qwen2 fields of ``llm_config.json``, the SigLIP fields of
    ``vit_config.json`` (after the official one-layer drop), the latent geometry."""

    vocab_size: int = 320
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    vit_hidden_size: int = 16
    vit_intermediate_size: int = 32
    vit_num_hidden_layers: int = 1
    vit_num_attention_heads: int = 2
    vit_patch_size: int = 4
    vit_image_size: int = 16
    vit_layer_norm_eps: float = 1e-6
    latent_channels: int = 16
    latent_patch_size: int = 2
    max_latent_size: int = 64
    vit_max_num_patch_per_side: int = 70
    timestep_shift: float = 3.0
    bos_token_id: int = 0
    eos_token_id: int = 0
    vision_start_token_id: int = 0
    vision_end_token_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_release(cls, llm: dict[str, Any], vit: dict[str, Any], **geometry: Any) -> BagelConfig:
        """From the released ``llm_config.json`` / ``vit_config.json`` contents (missing
        fields are an error naming them) plus the latent geometry."""
        need_llm = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        )
        need_vit = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "patch_size",
            "image_size",
        )
        for name, data, need in (
            ("llm_config.json", llm, need_llm),
            ("vit_config.json", vit, need_vit),
        ):
            missing = [k for k in need if k not in data]
            if missing:
                raise ValueError(f"{name}: missing fields {missing}")
        rope = llm.get("rope_theta", (llm.get("rope_parameters") or {}).get("rope_theta", 1e6))
        return cls(
            vocab_size=int(llm["vocab_size"]),
            hidden_size=int(llm["hidden_size"]),
            intermediate_size=int(llm["intermediate_size"]),
            num_hidden_layers=int(llm["num_hidden_layers"]),
            num_attention_heads=int(llm["num_attention_heads"]),
            num_key_value_heads=int(llm["num_key_value_heads"]),
            rms_norm_eps=float(llm.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope),
            vit_hidden_size=int(vit["hidden_size"]),
            vit_intermediate_size=int(vit["intermediate_size"]),
            # the official loaders use vit_config.num_hidden_layers - 1 layers
            vit_num_hidden_layers=int(vit["num_hidden_layers"]) - 1,
            vit_num_attention_heads=int(vit["num_attention_heads"]),
            vit_patch_size=int(vit["patch_size"]),
            vit_image_size=int(vit["image_size"]),
            vit_layer_norm_eps=float(vit.get("layer_norm_eps", 1e-6)),
            **geometry,
        )

    def siglip_config(self) -> Any:
        from transformers import SiglipVisionConfig

        return SiglipVisionConfig(
            hidden_size=self.vit_hidden_size,
            intermediate_size=self.vit_intermediate_size,
            num_hidden_layers=self.vit_num_hidden_layers,
            num_attention_heads=self.vit_num_attention_heads,
            patch_size=self.vit_patch_size,
            image_size=self.vit_image_size,
            layer_norm_eps=self.vit_layer_norm_eps,
            hidden_act="gelu_pytorch_tanh",
            attn_implementation="sdpa",
        )


# ------------------------------------------------------------------ modules
def sincos_2d(dim: int, grid: int) -> Tensor:
    """The fixed 2-D sin-cos table of the official ``PositionEmbedding`` (DiT's
    ``get_2d_sincos_pos_embed``), shape (grid * grid, dim): entry ``r * grid + c`` is
    ``[sin(c w), cos(c w), sin(r w), cos(r w)]`` with ``w_k = 10000^(-k / (dim / 4))``."""
    if dim % 4:
        raise ValueError(f"hidden_size: {dim} must be a multiple of 4 for 2-D sin-cos")
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    pos = torch.arange(grid, dtype=torch.float64)
    one = torch.cat([torch.outer(pos, omega).sin(), torch.outer(pos, omega).cos()], dim=1)
    cols = one[None, :, :].expand(grid, grid, -1)
    rows = one[:, None, :].expand(grid, grid, -1)
    return torch.cat([cols, rows], dim=-1).reshape(grid * grid, dim).float()


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class PositionEmbedding(nn.Module):
    """A frozen sin-cos table stored as a parameter ``pos_embed`` (as the release stores it)."""

    def __init__(self, grid: int, dim: int) -> None:
        super().__init__()
        self.grid = grid
        self.pos_embed = nn.Parameter(torch.zeros(grid * grid, dim), requires_grad=False)
        if self.pos_embed.device.type != "meta":
            self.pos_embed.data.copy_(sincos_2d(dim, grid))

    def forward(self, position_ids: Tensor) -> Tensor:
        return self.pos_embed[position_ids]


class BagelMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BagelMoTAttention(nn.Module):
    """Shared self-attention with per-expert projections and QK-norms (``PackedAttentionMoT``)."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.nq, self.nkv, self.d = nq, nkv, d
        for suffix in ("", "_moe_gen"):
            setattr(self, "q_proj" + suffix, nn.Linear(h, nq * d, bias=True))
            setattr(self, "k_proj" + suffix, nn.Linear(h, nkv * d, bias=True))
            setattr(self, "v_proj" + suffix, nn.Linear(h, nkv * d, bias=True))
            setattr(self, "o_proj" + suffix, nn.Linear(nq * d, h, bias=False))
            setattr(self, "q_norm" + suffix, nn.RMSNorm(d, eps=cfg.rms_norm_eps))
            setattr(self, "k_norm" + suffix, nn.RMSNorm(d, eps=cfg.rms_norm_eps))

    def _proj(self, name: str, x: Tensor, gen: Tensor) -> Tensor:
        und = getattr(self, name)(x)
        g = getattr(self, name + "_moe_gen")(x)
        return torch.where(gen[..., None], g, und)

    def forward(self, x: Tensor, gen: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self._proj("q_proj", x, gen).view(b, s, self.nq, self.d)
        k = self._proj("k_proj", x, gen).view(b, s, self.nkv, self.d)
        v = self._proj("v_proj", x, gen).view(b, s, self.nkv, self.d)
        g4 = gen[:, :, None, None]
        q = torch.where(g4, self.q_norm_moe_gen(q), self.q_norm(q)).transpose(1, 2)
        k = torch.where(g4, self.k_norm_moe_gen(k), self.k_norm(k)).transpose(1, 2)
        v = v.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.nq // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(b, s, self.nq * self.d)
        return self._proj("o_proj", out, gen)


class BagelMoTDecoderLayer(nn.Module):
    """One Mixture-of-Transformers layer (``Qwen2MoTDecoderLayer``; the FSDP wrap unit)."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = BagelMoTAttention(cfg)
        self.mlp = BagelMLP(h, cfg.intermediate_size)
        self.mlp_moe_gen = BagelMLP(h, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.input_layernorm_moe_gen = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm_moe_gen = nn.RMSNorm(h, eps=eps)

    def forward(self, x: Tensor, gen: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        g = gen[..., None]
        hid = torch.where(g, self.input_layernorm_moe_gen(x), self.input_layernorm(x))
        x = x + self.self_attn(hid, gen, cos, sin, mask)
        hid = torch.where(
            g, self.post_attention_layernorm_moe_gen(x), self.post_attention_layernorm(x)
        )
        return x + torch.where(g, self.mlp_moe_gen(hid), self.mlp(hid))


class BagelTextModel(nn.Module):
    """``language_model.model``: token embedding, MoT layers, per-expert final norms."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(BagelMoTDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm_moe_gen = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.gradient_checkpointing = False

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """RoPE tables (B, 1, S, head_dim) for integer positions (B, S)."""
        d = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, device=positions.device) / d))
        ang = positions.float()[..., None] * inv
        emb = torch.cat([ang, ang], dim=-1)[:, None]
        return emb.cos(), emb.sin()

    def forward(
        self, embeds: Tensor, gen: Tensor, positions: Tensor, valid: Tensor, block: Tensor
    ) -> Tensor:
        """Hidden states after the final (per-expert) norm.

        Token ``i`` attends to token ``j`` iff ``j`` is valid and (``j <= i`` or both lie in
        the same bidirectional block ``block > 0``), and always to itself."""
        s = embeds.shape[1]
        idx = torch.arange(s, device=embeds.device)
        causal = idx[None, :, None] >= idx[None, None, :]
        same = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] > 0)
        allowed = (causal | same) & valid[:, None, :].bool()
        allowed = allowed | torch.eye(s, dtype=torch.bool, device=embeds.device)[None]
        mask = allowed[:, None]
        cos, sin = self.rope(positions)
        x = embeds
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # keep each layer's input only; recompute its activations in the backward
                x = torch.utils.checkpoint.checkpoint(
                    layer, x, gen, cos, sin, mask, use_reentrant=False
                )
            else:
                x = layer(x, gen, cos, sin, mask)
        return torch.where(gen[..., None], self.norm_moe_gen(x), self.norm(x))


class BagelLanguageModel(nn.Module):
    """``language_model`` (``Qwen2ForCausalLM``): ``model`` + the text ``lm_head``."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.model = BagelTextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class BagelTimestepEmbedder(nn.Module):
    """``mlp([cos(t f), sin(t f)])`` with 256 frequencies ``f_k = 10000^(-k/128)`` (t in [0, 1])."""

    def __init__(self, hidden: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(
            nn.Linear(freq_dim, hidden, bias=True), nn.SiLU(), nn.Linear(hidden, hidden, bias=True)
        )

    def forward(self, t: Tensor) -> Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(
            -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half
        )
        args = t.float()[:, None] * freqs[None]
        emb = torch.cat([args.cos(), args.sin()], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class BagelMLPConnector(nn.Module):
    """``connector``: ViT width -> LLM width, ``fc2(gelu_tanh(fc1(x)))``."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, out_dim)
        self.fc2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class BagelVisionEmbeddings(nn.Module):
    """SigLIP NaViT embeddings: a linear patch embedding over ``(p, q, c)``-flattened pixel
    patches and a learned position embedding over ``max_side**2`` positions."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        p = cfg.vit_patch_size
        self.patch_embedding = nn.Linear(3 * p * p, cfg.vit_hidden_size, bias=True)
        n = (cfg.vit_image_size // p) ** 2
        self.position_embedding = nn.Embedding(n, cfg.vit_hidden_size)


class BagelVisionTransformer(nn.Module):
    """``vit_model.vision_model``: embeddings, SigLIP encoder layers, post layer norm."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        from transformers.models.siglip.modeling_siglip import SiglipEncoder

        self.embeddings = BagelVisionEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg.siglip_config())
        self.post_layernorm = nn.LayerNorm(cfg.vit_hidden_size, eps=cfg.vit_layer_norm_eps)


class BagelVisionModel(nn.Module):
    """``vit_model`` (the official ``SiglipVisionModel`` of ``siglip_navit.py``)."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.patch_size = cfg.vit_patch_size
        self.vision_model = BagelVisionTransformer(cfg)

    def forward(self, pixel_values: Tensor, position_ids: Tensor) -> Tensor:
        """Image tokens (B, N, D) for pixels (B, 3, H, W) and flattened positions (N,)."""
        b, c, h, w = pixel_values.shape
        p = self.patch_size
        patches = pixel_values.reshape(b, c, h // p, p, w // p, p)
        patches = patches.permute(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p), p * p * c)
        vm = self.vision_model
        x = vm.embeddings.patch_embedding(patches) + vm.embeddings.position_embedding(position_ids)
        x = vm.encoder(inputs_embeds=x).last_hidden_state
        return vm.post_layernorm(x)


class Bagel(nn.Module):
    """The unified model: MoT LLM + SigLIP understanding tower + flow-matching latent heads."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.config = cfg
        h, p, z = cfg.hidden_size, cfg.latent_patch_size, cfg.latent_channels
        self.language_model = BagelLanguageModel(cfg)
        self.time_embedder = BagelTimestepEmbedder(h)
        self.vae2llm = nn.Linear(p * p * z, h)
        self.llm2vae = nn.Linear(h, p * p * z)
        self.latent_pos_embed = PositionEmbedding(cfg.max_latent_size, h)
        self.vit_model = BagelVisionModel(cfg)
        self.connector = BagelMLPConnector(cfg.vit_hidden_size, h)
        self.vit_pos_embed = PositionEmbedding(cfg.vit_max_num_patch_per_side, h)

    @property
    def dtype(self) -> torch.dtype:
        return self.vae2llm.weight.dtype

    def enable_gradient_checkpointing(self) -> None:
        """Activation checkpointing per MoT layer (``from_pretrained(...,
        gradient_checkpointing=True)``)."""
        self.language_model.model.gradient_checkpointing = True

    # ------------------------------------------------------------- helpers
    def _text(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Embeddings, validity and positions (0.. over the valid tokens) of left-padded text."""
        valid = attention_mask.bool()
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        return self.language_model.model.embed_tokens(input_ids), valid, pos

    def _special(self, token_id: int, b: int, device: torch.device) -> Tensor:
        ids = torch.full((b, 1), token_id, dtype=torch.long, device=device)
        return self.language_model.model.embed_tokens(ids)

    # ------------------------------------------------------------ generation
    def velocity(
        self, latents: Tensor, t: Tensor, input_ids: Tensor, attention_mask: Tensor
    ) -> Tensor:
        """Flow velocity ``eps - x0`` for VAE latents ``x_t`` (B, z, h, w) at times ``t`` (B,)
        given the prompt tokens: sequence ``[text, <vs>, latent patches, <ve>]``."""
        cfg = self.config
        b, z, hh, ww = latents.shape
        p = cfg.latent_patch_size
        if hh % p or ww % p:
            raise ValueError(f"latents: spatial size {(hh, ww)} not divisible by patch {p}")
        gh, gw = hh // p, ww // p
        if gh > cfg.max_latent_size or gw > cfg.max_latent_size:
            raise ValueError(
                f"latents: grid {(gh, gw)} exceeds max_latent_size {cfg.max_latent_size}"
            )
        dt = self.dtype
        patches = latents.reshape(b, z, gh, p, gw, p).permute(0, 2, 4, 3, 5, 1)
        patches = patches.reshape(b, gh * gw, p * p * z).to(dt)
        rows = torch.arange(gh, device=latents.device)[:, None] * cfg.max_latent_size
        pos_idx = (rows + torch.arange(gw, device=latents.device)[None]).flatten()
        lat = (
            self.vae2llm(patches) + self.time_embedder(t)[:, None] + self.latent_pos_embed(pos_idx)
        )
        text, valid, pos = self._text(input_ids, attention_mask)
        n = gh * gw
        dev = latents.device
        embeds = torch.cat(
            [
                text,
                self._special(cfg.vision_start_token_id, b, dev),
                lat.to(text.dtype),
                self._special(cfg.vision_end_token_id, b, dev),
            ],
            dim=1,
        )
        length = text.shape[1]
        gen = torch.zeros(b, length + n + 2, dtype=torch.bool, device=dev)
        gen[:, length + 1 : length + 1 + n] = True
        valid = torch.cat([valid, torch.ones(b, n + 2, dtype=torch.bool, device=dev)], 1)
        image_pos = valid[:, :length].sum(-1, keepdim=True).expand(b, n + 2)
        positions = torch.cat([pos, image_pos], 1)
        block = torch.zeros(b, length + n + 2, dtype=torch.long, device=dev)
        block[:, length:] = 1
        hid = self.language_model.model(embeds, gen, positions, valid, block)
        out = self.llm2vae(hid[:, length + 1 : length + 1 + n])
        out = out.reshape(b, gh, gw, p, p, z).permute(0, 5, 1, 3, 2, 4)
        return out.reshape(b, z, hh, ww)

    # --------------------------------------------------------- understanding
    def understand_logits(
        self, input_ids: Tensor, attention_mask: Tensor, pixel_values: Tensor | None = None
    ) -> Tensor:
        """Next-token logits (B, L, V) of the text; with ``pixel_values`` (B, 3, H, W) the image
        block ``[<vs>, ViT tokens, <ve>]`` comes first (bidirectional within itself)."""
        text, valid, pos = self._text(input_ids, attention_mask)
        b = input_ids.shape[0]
        dev = input_ids.device
        cfg = self.config
        if pixel_values is None:
            embeds, gen_len, block = text, 0, torch.zeros_like(input_ids)
            positions = pos
        else:
            p, grid = cfg.vit_patch_size, cfg.vit_max_num_patch_per_side
            gh, gw = pixel_values.shape[-2] // p, pixel_values.shape[-1] // p
            if gh * p != pixel_values.shape[-2] or gw * p != pixel_values.shape[-1]:
                raise ValueError(f"pixel_values: size not a multiple of the ViT patch {p}")
            if (
                max(gh, gw) > grid
                or gh * gw
                > self.vit_model.vision_model.embeddings.position_embedding.num_embeddings
            ):
                raise ValueError(f"pixel_values: {gh}x{gw} patches do not fit the {grid} grid")
            idx = (
                torch.arange(gh, device=dev)[:, None] * grid + torch.arange(gw, device=dev)
            ).flatten()
            vit = self.vit_model(pixel_values.to(self.dtype), idx)
            img = self.connector(vit) + self.vit_pos_embed(idx)
            m = img.shape[1] + 2
            embeds = torch.cat(
                [
                    self._special(cfg.vision_start_token_id, b, dev),
                    img.to(text.dtype),
                    self._special(cfg.vision_end_token_id, b, dev),
                    text,
                ],
                dim=1,
            )
            gen_len = m
            valid = torch.cat([torch.ones(b, m, dtype=torch.bool, device=dev), valid], 1)
            positions = torch.cat([torch.zeros(b, m, dtype=torch.long, device=dev), pos + 1], 1)
            block = torch.cat(
                [torch.ones(b, m, dtype=torch.long, device=dev), torch.zeros_like(input_ids)], 1
            )
        gen = torch.zeros(embeds.shape[:2], dtype=torch.bool, device=dev)
        hid = self.language_model.model(embeds, gen, positions, valid, block)
        return self.language_model.lm_head(hid[:, gen_len:])


# ------------------------------------------------------------- release reading
def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118


def release_geometry(ema: dict[str, tuple[int, ...]], latent_channels: int) -> dict[str, int]:
    """``latent_patch_size``, ``max_latent_size`` and ``vit_max_num_patch_per_side`` read
    from the shapes of ``vae2llm.weight``, ``latent_pos_embed.pos_embed`` and
    ``vit_pos_embed.pos_embed`` (the official code hard-codes 2, 64 and 70)."""
    for k in ("vae2llm.weight", "latent_pos_embed.pos_embed", "vit_pos_embed.pos_embed"):
        if k not in ema:
            raise ValueError(f"ema.safetensors: missing {k}")
    patch = math.isqrt(ema["vae2llm.weight"][1] // latent_channels)
    latent = math.isqrt(ema["latent_pos_embed.pos_embed"][0])
    vit = math.isqrt(ema["vit_pos_embed.pos_embed"][0])
    if patch * patch * latent_channels != ema["vae2llm.weight"][1]:
        raise ValueError(
            f"ema.safetensors: vae2llm.weight {ema['vae2llm.weight']} does not fit "
            f"{latent_channels} latent channels"
        )
    return {
        "latent_patch_size": patch,
        "max_latent_size": latent,
        "vit_max_num_patch_per_side": vit,
    }


def _token_ids(tok: Any) -> dict[str, int]:
    vocab = tok.get_vocab()
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise ValueError(f"tokenizer: BAGEL needs the special tokens {missing}")
    return {
        "bos_token_id": vocab["<|im_start|>"],
        "eos_token_id": vocab["<|im_end|>"],
        "vision_start_token_id": vocab["<|vision_start|>"],
        "vision_end_token_id": vocab["<|vision_end|>"],
    }


# ------------------------------------------------------------------- adapter
@register_adapter(ARCHITECTURE, family=FAMILY)
class BagelAdapter(DiffusionAdapter):
    """BAGEL text-to-image adapter (the generation expert trains by default)."""

    modality: ClassVar[str] = "image"
    cfg_param: ClassVar[str] = "guidance_scale"
    trainable_component: ClassVar[str] = "bagel"
    lora_target_modules: ClassVar[tuple[str, ...]] = BAGEL_LORA_TARGETS
    no_split_modules: ClassVar[tuple[str, ...]] = ("BagelMoTDecoderLayer",)
    shift: ClassVar[float] = 3.0

    @classmethod
    def load_components(
        cls, path: Path, *, dtype: torch.dtype, device: torch.device, skip: Any = ()
    ) -> dict[str, Any]:
        """The released folder: ``llm_config.json`` + ``vit_config.json`` + ``ema.safetensors``
        (the model, strict) + ``ae.safetensors`` (FLUX autoencoder) + tokenizer files. On the
        meta device only the two configs are read (released geometry and autoencoder)."""
        from diffusers import AutoencoderKL

        llm = json.loads((path / "llm_config.json").read_text())
        vit = json.loads((path / "vit_config.json").read_text())
        out: dict[str, Any] = {}
        if device.type == "meta":
            cfg = BagelConfig.from_release(llm, vit, **RELEASED_CONSTANTS)
            with torch.device("meta"):
                out["bagel"] = Bagel(cfg).to(dtype=dtype).eval()
                if "vae" not in skip:
                    out["vae"] = AutoencoderKL(**flux_ae.released_config())
            return out
        ema_file, ae_file = path / "ema.safetensors", path / "ae.safetensors"
        for f in (ema_file, ae_file):
            if not f.is_file():
                raise FileNotFoundError(f"{f}: the released BAGEL folder has no {f.name}")
        ae_state = read_safetensors(ae_file)
        ae_cfg = flux_ae.autoencoder_config({k: v.shape for k, v in ae_state.items()})
        tok = None
        ids: dict[str, int] = {}
        if "tokenizer" not in skip:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
            tok.padding_side = "left"
            ids = _token_ids(tok)
        geometry = release_geometry(_shapes(ema_file), ae_cfg["latent_channels"])
        cfg = BagelConfig.from_release(
            llm, vit, latent_channels=ae_cfg["latent_channels"], **geometry, **ids
        )
        with torch.device("meta"):
            model = Bagel(cfg)
        load_state_strict(model, read_safetensors(ema_file), str(ema_file), assign=True)
        model.latent_pos_embed.pos_embed.requires_grad_(False)
        model.vit_pos_embed.pos_embed.requires_grad_(False)
        out["bagel"] = model.to(device=device, dtype=dtype).eval()
        if "vae" not in skip:
            with torch.device("meta"):
                vae = AutoencoderKL(**ae_cfg)
            load_state_strict(vae, flux_ae.to_diffusers_state(ae_state), str(ae_file), assign=True)
            vae = vae.to(device=device)
            out["vae"] = (vae if vae.dtype == dtype else vae.to(dtype=dtype)).eval()
        if tok is not None:
            out["tokenizer"] = tok
        return out

    @property
    def max_text_length(self) -> int:
        """Prompt tokens per row including ``<|im_start|>`` / ``<|im_end|>`` (option
        ``max_sequence_length``, default 64)."""
        return int(self.options.get("max_sequence_length", 64))

    def component_config(self, name: str) -> Any:
        if name == "vae" and "vae" not in self.components:
            raise ValueError("component 'vae': stripped (BAGEL's autoencoder has no config file)")
        return super().component_config(name)

    def encode_prompts(self, prompts: list[str], **inputs: Any) -> dict[str, Tensor]:
        """``input_ids`` (B, L) int64 and ``attention_mask`` (B, L), left padded: each prompt
        is ``<|im_start|> text <|im_end|>`` (the official ``prepare_prompts``); the empty
        prompt is no token at all (the inferencer's empty context for text CFG)."""
        tok = self.components["tokenizer"]
        cfg = self.model.config
        n = self.max_text_length
        rows = []
        for p in prompts:
            ids = [] if p == "" else tok.encode(p, add_special_tokens=False)
            if ids:
                ids = [cfg.bos_token_id, *ids[: n - 2], cfg.eos_token_id]
            rows.append(ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        input_ids = torch.full((len(rows), n), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), n), dtype=torch.long)
        for i, ids in enumerate(rows):
            if ids:
                input_ids[i, n - len(ids) :] = torch.tensor(ids)
                mask[i, n - len(ids) :] = 1
        return {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}

    def latent_shape(self, params: Any) -> tuple[int, ...]:
        """(z, H / f, W / f) with ``f`` the VAE factor; H / f must be a multiple of the patch."""
        vae = self.components["vae"]
        f = 2 ** (len(vae.config.block_out_channels) - 1)
        p = self.model.config.latent_patch_size
        h, w = int(params.height), int(params.width)
        for name, v in (("height", h), ("width", w)):
            if v <= 0 or v % (f * p):
                raise ValueError(f"{name}: {v} is not a positive multiple of {f * p}")
        return (int(vae.config.latent_channels), h // f, w // f)

    def transformer_forward(
        self, latents: Tensor, sigma: Tensor, condition: dict[str, Tensor], params: Any
    ) -> Tensor:
        return self.model.velocity(
            latents, sigma, condition["input_ids"].long(), condition["attention_mask"].long()
        )

    def understand(self, prompts: list[str], images: Tensor | None = None) -> Tensor:
        """Understanding path: next-token logits (B, L, V) for ``prompts`` (left padded), with
        optional images (B, 3, H, W) in [-1, 1] read by the SigLIP tower."""
        cond = self.encode_prompts(prompts)
        return self.model.understand_logits(
            cond["input_ids"],
            cond["attention_mask"],
            None if images is None else images.to(self.device),
        )


# ------------------------------------------------------------------- tiny model
@register_tiny(FAMILY, revision=2)  # 2: the released folder layout and parameter names
def build_tiny(path: str | Path, seed: int = 0) -> Path:
    """Tiny BAGEL in the released layout (``llm_config.json``, ``vit_config.json``,
    ``ema.safetensors``, ``ae.safetensors``, Qwen2 tokenizer files): MoT LLM hidden 32 (4
    heads, 2 KV heads, 2 layers, both experts), SigLIP tower (hidden 16, 1 layer, 16 px / 4 px
    patches, 4 x 4 position grid), latent patch 2 over a 16 x 16 latent grid, FLUX-layout
    autoencoder with 32 channels (GroupNorm 32, as released), 4 latent channels, factor 2
    (32 px -> 4 x 16 x 16 latents -> 64 tokens); 16 prompt tokens. Also writes a
    ``config.json`` naming the architecture (the release's own has no ``architectures``)."""
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    from ..tokenizers_tiny import qwen2_tokenizer

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok = qwen2_tokenizer(max_length=64)
    llm = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 320,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    vit = {
        "model_type": "siglip_vision_model",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,  # the loader drops one, as the official code does
        "num_attention_heads": 2,
        "image_size": 16,
        "patch_size": 4,
    }
    ae_cfg = {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ("DownEncoderBlock2D",) * 2,
        "up_block_types": ("UpDecoderBlock2D",) * 2,
        "block_out_channels": (32, 32),
        "layers_per_block": 1,
        "latent_channels": 4,
        "norm_num_groups": 32,
        "scaling_factor": flux_ae.FLUX_SCALE,
        "shift_factor": flux_ae.FLUX_SHIFT,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
    }
    cfg = BagelConfig.from_release(
        llm,
        vit,
        latent_channels=4,
        latent_patch_size=2,
        max_latent_size=16,
        vit_max_num_patch_per_side=4,
        **_token_ids(tok),
    )
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"vocab_size: {cfg.vocab_size} < tokenizer size {len(tok)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Bagel(cfg)
        vae = AutoencoderKL(**ae_cfg)
    (root / "llm_config.json").write_text(json.dumps(llm, indent=2) + "\n")
    (root / "vit_config.json").write_text(json.dumps(vit, indent=2) + "\n")
    (root / "config.json").write_text(json.dumps({"architectures": [ARCHITECTURE]}) + "\n")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(root / "ema.safetensors"), metadata={"format": "pt"})
    ae_state = flux_ae.from_diffusers_state(vae.state_dict())
    save_file({k: v.contiguous() for k, v in ae_state.items()}, str(root / "ae.safetensors"))
    tok.save_pretrained(root)
    write_adapter_options(root, max_sequence_length=16)
    return root
