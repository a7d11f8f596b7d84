"""BAGEL (Deng et al. 2025, "Emerging Properties in Unified Multimodal Pretraining"): one
decoder-only transformer for understanding and generation. There is no diffusers or
transformers class, so this module defines the model itself, in the layout of the released
``BAGEL-7B-MoT`` checkpoint (parameter names follow it):

Covered
- ``language_model``: a Qwen2-style decoder (RMSNorm, RoPE, GQA, QK-norm, SwiGLU) turned into a
  *Mixture-of-Transformers*: every layer holds two experts with identical shapes, the
  understanding expert (``q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, mlp,
  input_layernorm, post_attention_layernorm``) and the generation expert (the same names with
  ``_moe_gen``); text and ViT tokens use the first, VAE-latent tokens the second, and one
  self-attention runs over the whole packed sequence. Final norms ``norm`` / ``norm_moe_gen``
  and the ``lm_head`` for text.
- understanding: a SigLIP vision tower (``vit_model``, transformers ``SiglipVisionModel``), the
  MLP ``connector`` to the LLM width and a fixed 2-D sin-cos ``vit_pos_embed``; image tokens sit
  between ``<|vision_start|>`` and ``<|vision_end|>`` and attend to each other bidirectionally.
- generation (text to image, rectified flow): VAE latents are patchified ``p x p``
  (``latent_patch_size`` 2), projected by ``vae2llm``, plus ``time_embedder(t)`` (sinusoidal +
  MLP) and a fixed 2-D sin-cos ``latent_pos_embed``; the latent block sits between the vision
  start/end tokens after the prompt, is fully bidirectional within itself and causal to the
  text; ``llm2vae`` maps the generation expert's output back to patches: the velocity
  ``v = eps - x0`` for ``x_t = (1 - t) x0 + t eps``. Timesteps shifted
  ``t' = s t / (1 + (s - 1) t)`` with ``timestep_shift`` 3 (the released inference default).
  The VAE is a diffusers ``AutoencoderKL`` in the FLUX layout (``scaling_factor`` /
  ``shift_factor``), which is what BAGEL ships as ``ae.safetensors``.

Not covered: NaViT packing of several images of native resolution in one sequence (one
fixed-size image per row here), the KV-cache inference path (every velocity call re-runs the
prompt; exact, just slower), image editing / interleaved conditioning, CFG renormalisation
and image CFG (plain text CFG only), the "thinking" text mode, and the released SigLIP2
NaViT position interpolation.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..base import register_adapter, write_adapter_options
from ..diffusion import DiffusionAdapter
from ..tiny import register_tiny

__all__ = [
    "BAGEL_LORA_TARGETS",
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


# ------------------------------------------------------------------- config
@dataclass
class BagelConfig:
    """BAGEL hyper-parameters (``llm_config`` Qwen2-style, ``vit_config`` SigLIP)."""

    vocab_size: int = 320
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = True
    latent_channels: int = 4
    latent_patch_size: int = 2
    max_latent_size: int = 16
    timestep_shift: float = 3.0
    vit_config: dict[str, Any] = field(default_factory=dict)
    vit_max_num_patch_per_side: int = 8
    vision_start_token_id: int = 0
    vision_end_token_id: int = 0
    pad_token_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_json(self) -> dict[str, Any]:
        return {"architectures": [ARCHITECTURE], "model_type": "bagel", **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BagelConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known - {"architectures", "model_type"})
        if unknown:
            raise ValueError(f"config.json: unknown BAGEL fields {unknown}")
        return cls(**{k: v for k, v in data.items() if k in known})


# ------------------------------------------------------------------ modules
def _sincos_2d(dim: int, grid: int) -> Tensor:
    """Fixed 2-D sin-cos position table (grid*grid, dim): half the channels encode the row,
    half the column, each as ``[sin(p w_k), cos(p w_k)]`` with ``w_k = 10000^(-k / (dim/4))``."""
    if dim % 4:
        raise ValueError(f"hidden_size: {dim} must be a multiple of 4 for 2-D sin-cos")
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    pos = torch.arange(grid, dtype=torch.float64)
    emb = torch.outer(pos, omega)
    one = torch.cat([emb.sin(), emb.cos()], dim=1)  # (grid, dim/2)
    rows = one[:, None, :].expand(grid, grid, -1)
    cols = one[None, :, :].expand(grid, grid, -1)
    return torch.cat([rows, cols], dim=-1).reshape(grid * grid, dim).float()


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


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
    """Shared self-attention with per-expert projections and QK-norms."""

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
            norm = (lambda: nn.RMSNorm(d, eps=cfg.rms_norm_eps)) if cfg.qk_norm else nn.Identity
            setattr(self, "q_norm" + suffix, norm())
            setattr(self, "k_norm" + suffix, norm())

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
    """One Mixture-of-Transformers layer (the FSDP wrap unit)."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = BagelMoTAttention(cfg)
        self.input_layernorm = nn.RMSNorm(h, eps=eps)
        self.input_layernorm_moe_gen = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
        self.post_attention_layernorm_moe_gen = nn.RMSNorm(h, eps=eps)
        self.mlp = BagelMLP(h, cfg.intermediate_size)
        self.mlp_moe_gen = BagelMLP(h, cfg.intermediate_size)

    def forward(self, x: Tensor, gen: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        g = gen[..., None]
        hid = torch.where(g, self.input_layernorm_moe_gen(x), self.input_layernorm(x))
        x = x + self.self_attn(hid, gen, cos, sin, mask)
        hid = torch.where(
            g, self.post_attention_layernorm_moe_gen(x), self.post_attention_layernorm(x)
        )
        return x + torch.where(g, self.mlp_moe_gen(hid), self.mlp(hid))


class BagelLanguageModel(nn.Module):
    """The MoT decoder: token embedding, layers, per-expert final norms, text head."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(BagelMoTDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm_moe_gen = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

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
        for layer in self.layers:
            x = layer(x, gen, cos.to(x.dtype), sin.to(x.dtype), mask)
        return torch.where(gen[..., None], self.norm_moe_gen(x), self.norm(x))


class BagelTimestepEmbedder(nn.Module):
    """``mlp(sinusoid(t))`` with 256 frequencies (t in [0, 1])."""

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


class Bagel(nn.Module):
    """The unified model: MoT LLM + SigLIP understanding tower + flow-matching latent heads."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        self.config = cfg
        h, p, z = cfg.hidden_size, cfg.latent_patch_size, cfg.latent_channels
        self.language_model = BagelLanguageModel(cfg)
        vit_cfg = SiglipVisionConfig(**cfg.vit_config)
        self.vit_model = SiglipVisionModel(vit_cfg)
        self.connector = nn.Sequential(
            nn.Linear(vit_cfg.hidden_size, h), nn.GELU(approximate="tanh"), nn.Linear(h, h)
        )
        self.vae2llm = nn.Linear(p * p * z, h)
        self.llm2vae = nn.Linear(h, p * p * z)
        self.time_embedder = BagelTimestepEmbedder(h)
        self.register_buffer(
            "latent_pos_embed", _sincos_2d(h, cfg.max_latent_size), persistent=False
        )
        self.register_buffer(
            "vit_pos_embed", _sincos_2d(h, cfg.vit_max_num_patch_per_side), persistent=False
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.vae2llm.weight.dtype

    # ------------------------------------------------------------- helpers
    def _text(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Embeddings, validity and positions (0.. over the valid tokens) of left-padded text."""
        valid = attention_mask.bool()
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
        return self.language_model.embed_tokens(input_ids), valid, pos

    def _special(self, token_id: int, b: int, device: torch.device) -> Tensor:
        ids = torch.full((b, 1), token_id, dtype=torch.long, device=device)
        return self.language_model.embed_tokens(ids)

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
            self.vae2llm(patches) + self.time_embedder(t)[:, None] + self.latent_pos_embed[pos_idx]
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
        hid = self.language_model(embeds, gen, positions, valid, block)
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
        if pixel_values is None:
            embeds, gen_len, block = text, 0, torch.zeros_like(input_ids)
            positions = pos
        else:
            vit = self.vit_model(pixel_values=pixel_values.to(self.dtype)).last_hidden_state
            side = math.isqrt(vit.shape[1])
            grid = self.config.vit_max_num_patch_per_side
            if side * side != vit.shape[1] or side > grid:
                raise ValueError(
                    f"pixel_values: {vit.shape[1]} ViT patches do not fit a {grid} grid"
                )
            idx = (
                torch.arange(side, device=dev)[:, None] * grid + torch.arange(side, device=dev)
            ).flatten()
            img = self.connector(vit) + self.vit_pos_embed[idx]
            m = img.shape[1] + 2
            embeds = torch.cat(
                [
                    self._special(self.config.vision_start_token_id, b, dev),
                    img.to(text.dtype),
                    self._special(self.config.vision_end_token_id, b, dev),
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
        hid = self.language_model(embeds, gen, positions, valid, block)
        return self.language_model.lm_head(hid[:, gen_len:])


# ------------------------------------------------------------------- adapter
@register_adapter(ARCHITECTURE, family=FAMILY)
class BagelAdapter(DiffusionAdapter):
    """BAGEL text-to-image adapter (the generation expert trains by default)."""

    modality: ClassVar[str] = "image"
    cfg_param: ClassVar[str] = "guidance_scale"
    trainable_component: ClassVar[str] = "bagel"
    lora_target_modules: ClassVar[tuple[str, ...]] = BAGEL_LORA_TARGETS
    no_split_modules: ClassVar[tuple[str, ...]] = ("BagelMoTDecoderLayer",)
    mixed_precision: ClassVar[dict[str, str | None]] = {
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "output_dtype": "float32",
    }
    shift: ClassVar[float] = 3.0

    @classmethod
    def load_components(
        cls, path: Path, *, dtype: torch.dtype, device: torch.device, skip: Any = ()
    ) -> dict[str, Any]:
        """``config.json`` + ``model.safetensors`` (the unified model, strict), ``vae/``
        (diffusers AutoencoderKL) and ``tokenizer/``."""
        from diffusers import AutoencoderKL
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        cfg = BagelConfig.from_json(json.loads((path / "config.json").read_text()))
        model = Bagel(cfg)
        state = load_file(str(path / "model.safetensors"))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{path / 'model.safetensors'}: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        out: dict[str, Any] = {"bagel": model.to(device=device, dtype=dtype).eval()}
        if "vae" not in skip:
            out["vae"] = AutoencoderKL.from_pretrained(path / "vae", torch_dtype=dtype).to(device)
            out["vae"].eval()
        if "tokenizer" not in skip:
            tok = AutoTokenizer.from_pretrained(path / "tokenizer")
            tok.padding_side = "left"
            out["tokenizer"] = tok
        return out

    @property
    def max_text_length(self) -> int:
        """Prompt tokens per row (option ``max_sequence_length``, default 64)."""
        return int(self.options.get("max_sequence_length", 64))

    def encode_prompts(self, prompts: list[str], **inputs: Any) -> dict[str, Tensor]:
        """``input_ids`` (B, L) int64 and ``attention_mask`` (B, L), left padded: the LLM reads
        the prompt inside every velocity call (no KV cache), so LoRA on the understanding
        expert would also reach the prompt."""
        tok = self.components["tokenizer"]
        tok.padding_side = "left"
        enc = tok(
            list(prompts),
            padding="max_length",
            max_length=self.max_text_length,
            truncation=True,
            return_tensors="pt",
        )
        return {
            "input_ids": enc.input_ids.to(self.device),
            "attention_mask": enc.attention_mask.to(self.device),
        }

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
@register_tiny(FAMILY)
def build_tiny(path: str | Path, seed: int = 0) -> Path:
    """Tiny BAGEL: MoT LLM hidden 32 (4 heads, 2 KV heads, 2 layers, both experts), SigLIP tower
    (hidden 16, 1 layer, 16 px / 4 px patches), latent patch 2, FLUX-layout AutoencoderKL with
    4 latent channels and factor 2 (32 px -> 4 x 16 x 16 latents -> 64 tokens), Qwen2 byte-level
    tokenizer with the vision start/end tokens; 16 prompt tokens."""
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    from ..tokenizers_tiny import qwen2_tokenizer

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok = qwen2_tokenizer(max_length=64)
    cfg = BagelConfig(
        vocab_size=320,
        vit_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 4,
        },
        vit_max_num_patch_per_side=4,
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"vocab_size: {cfg.vocab_size} < tokenizer size {len(tok)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Bagel(cfg)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=4,
            sample_size=32,
            scaling_factor=0.3611,
            shift_factor=0.1159,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
    (root / "config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    vae.save_pretrained(root / "vae", safe_serialization=True)
    tok.save_pretrained(root / "tokenizer")
    write_adapter_options(root, max_sequence_length=16)
    return root
