"""Qwen-Image (``QwenImagePipeline``): MMDiT over packed 2x2 latent patches, Qwen2.5-VL text
encoder, Wan-style 3D causal VAE with per-channel latent mean/std.

As in the diffusers pipeline: the prompt goes into a chat template; the encoder's last hidden
states of the valid tokens, minus the template prefix, are the text condition (with a mask);
latents ``(C, h, w)`` are packed into ``(h/2 * w/2, 4C)`` tokens for the transformer, which
takes ``timestep = sigma`` and the per-row image shapes for its RoPE. True CFG
(``true_cfg_scale > 1``) mixes the branches and rescales to the conditional norm per token:
``v = c * ||v_pos|| / ||c||``, ``c = v_neg + s (v_pos - v_neg)``. Sigmas: ``linspace(1, 1/N,
N)`` with resolution-dependent exponential shift ``mu`` (linear in the image token count).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..base import module_dtype, register_adapter, write_adapter_options
from ..diffusion import DiffusionAdapter, latent_channel_stats, to_uint8
from ..tiny import register_tiny

__all__ = ["QWEN_LORA_TARGETS", "QwenImageAdapter", "build_tiny_qwen_image", "pack", "unpack"]

QWEN_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)

# Qwen-Image-Edit's template (the Edit adapters use it); it lives here so that the tiny
# tokenizer every Qwen-Image family shares knows its words without importing the Edit module.
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should alter "
    "or modify the image. Generate a new image that meets the user's requirements while "
    "maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def pack(latents: Tensor) -> Tensor:
    """``(B, C, h, w)`` -> ``(B, h/2 * w/2, 4C)`` (2x2 patches, channel-major inside a patch)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: Tensor, h: int, w: int) -> Tensor:
    """Inverse of :func:`pack`."""
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def calculate_shift(
    seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float
) -> float:
    """``mu`` linear in the image token count (Flux/Qwen-Image dynamic shifting)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return seq_len * m + (base_shift - m * base_seq_len)


@register_adapter("QwenImagePipeline", family="qwen_image")
class QwenImageAdapter(DiffusionAdapter):
    """Qwen-Image text-to-image adapter."""

    modality: ClassVar[str] = "image"
    cfg_param: ClassVar[str] = "true_cfg_scale"
    lora_target_modules: ClassVar[tuple[str, ...]] = QWEN_LORA_TARGETS
    no_split_modules: ClassVar[tuple[str, ...]] = ("QwenImageTransformerBlock",)
    prompt_template: ClassVar[str] = PROMPT_TEMPLATE

    # ---------------------------------------------------------------- text
    @property
    def max_text_length(self) -> int:
        """Text tokens per prompt after the template prefix (option ``max_sequence_length``;
        default min(512, tokenizer.model_max_length))."""
        tok = self.components["tokenizer"]
        return int(self.options.get("max_sequence_length", min(512, int(tok.model_max_length))))

    @property
    def template_drop(self) -> int:
        """Tokens of the template before the user text (34 with the released tokenizer)."""
        tok = self.components["tokenizer"]
        prefix = self.prompt_template.split("{}")[0]
        return len(tok(prefix, add_special_tokens=False).input_ids)

    def _encode_template(
        self, texts: list[str], extra: dict[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        tok = self.components["tokenizer"]
        enc = self.components["text_encoder"]
        drop, length = self.template_drop, self.max_text_length
        ids = tok(
            texts,
            max_length=drop + length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        out = enc(
            input_ids=ids.input_ids,
            attention_mask=ids.attention_mask,
            output_hidden_states=True,
            **(extra or {}),
        )
        hidden = out.hidden_states[-1].float()
        embeds = hidden.new_zeros(len(texts), length, hidden.shape[-1])
        mask = torch.zeros(len(texts), length, dtype=torch.long, device=hidden.device)
        for i in range(len(texts)):
            valid = hidden[i][ids.attention_mask[i].bool()][drop:]
            embeds[i, : valid.shape[0]] = valid
            mask[i, : valid.shape[0]] = 1
        return embeds, mask

    def encode_prompts(self, prompts: list[str], **inputs: Any) -> dict[str, Tensor]:
        """``prompt_embeds`` (B, L, D) zero-padded and ``prompt_embeds_mask`` (B, L)."""
        embeds, mask = self._encode_template([self.prompt_template.format(p) for p in prompts])
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    # -------------------------------------------------------------- latents
    @property
    def vae_scale_factor(self) -> int:
        return 2 ** len(self.component_config("vae").temperal_downsample)

    def latent_hw(self, params: Any) -> tuple[int, int]:
        f = self.vae_scale_factor
        h, w = int(params.height), int(params.width)
        for name, v in (("height", h), ("width", w)):
            if v <= 0 or v % (2 * f):
                raise ValueError(f"{name}: {v} is not a positive multiple of {2 * f}")
        return h // f, w // f

    def latent_shape(self, params: Any) -> tuple[int, ...]:
        """(z_dim, H / f, W / f)."""
        h, w = self.latent_hw(params)
        return (int(self.component_config("vae").z_dim), h, w)

    def schedule_sigmas(self, params: Any) -> list[float]:
        n = int(params.num_steps)
        return torch.linspace(1.0, 1.0 / n, n, dtype=torch.float64).tolist()

    def shift_mu(self, params: Any) -> float | None:
        cfg = self.components["scheduler"].config
        if not cfg.get("use_dynamic_shifting", False):
            return None
        h, w = self.latent_hw(params)
        return calculate_shift(
            (h // 2) * (w // 2),
            cfg.get("base_image_seq_len", 256),
            cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.5),
            cfg.get("max_shift", 1.15),
        )

    def combine_cfg(self, pos: Tensor, neg: Tensor, scale: float) -> Tensor:
        """True CFG with the per-token norm rescale of the Qwen-Image pipeline."""
        h, w = pos.shape[-2:]
        p, n = pack(pos), pack(neg)
        comb = n + scale * (p - n)
        comb = comb * (p.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
        return unpack(comb, h, w)

    def transformer_forward(
        self, latents: Tensor, sigma: Tensor, condition: dict[str, Tensor], params: Any
    ) -> Tensor:
        b, _, h, w = latents.shape
        dt = module_dtype(self.model)
        out = self.model(
            hidden_states=pack(latents).to(dt),
            encoder_hidden_states=condition["prompt_embeds"].to(dt),
            encoder_hidden_states_mask=condition["prompt_embeds_mask"],
            timestep=sigma.to(dt),
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return unpack(out, h, w)

    # ------------------------------------------------------------------ decode
    def vae_unscale(self, latents: Tensor) -> Tensor:
        """Model latents -> VAE latents: ``z * std + mean`` per channel."""
        mean, std = latent_channel_stats(self.component_config("vae"), latents)
        return latents * std + mean

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """(B, C, h, w) -> uint8 (B, H, W, 3) via the 3D VAE on one frame."""
        vae = self.components["vae"]
        z = self.vae_unscale(latents.to(self.device, torch.float32)).unsqueeze(2).to(vae.dtype)
        x = vae.decode(z, return_dict=False)[0][:, :, 0]
        return to_uint8(x)


# ------------------------------------------------------------------ tiny build
def tiny_qwen25vl(tokenizer, hidden: int = 32, seed: int = 0):
    """A tiny ``Qwen2_5_VLForConditionalGeneration`` (2 text layers, 1 vision block, M-RoPE)
    whose special-token ids match ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    ids = tokenizer.convert_tokens_to_ids
    head_dim = hidden // 2
    cfg = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 512,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16],
            },
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 16,
            "out_hidden_size": hidden,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def tiny_qwen_components(seed: int, *, zero_cond_t: bool = False) -> dict[str, Any]:
    """Tiny Qwen-Image components: transformer (2 blocks, hidden 32, RoPE axes 4/6/6),
    VAE (base_dim 8, scale factor 4, z_dim 16), Qwen2.5-VL encoder (hidden 32), tokenizer
    (``model_max_length`` 1024 as released; the tiny folder's ``omni_adapter.json`` sets 32
    text tokens after the template), flow-matching scheduler with the release's dynamic
    exponential shift."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )

    from ..tokenizers_tiny import qwen2_tokenizer

    tok = qwen2_tokenizer(max_length=1024, words_from=(PROMPT_TEMPLATE, EDIT_TEMPLATE))
    encoder = tiny_qwen25vl(tok, hidden=32, seed=seed)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
        zero_cond_t=zero_cond_t,
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": encoder,
        "tokenizer": tok,
        "scheduler": scheduler,
    }


@register_tiny("qwen_image")
def build_tiny_qwen_image(path: Path, seed: int) -> None:
    """Tiny Qwen-Image pipeline folder (see :func:`tiny_qwen_components`)."""
    from diffusers import QwenImagePipeline

    QwenImagePipeline(**tiny_qwen_components(seed)).save_pretrained(path, safe_serialization=True)
    write_adapter_options(path, max_sequence_length=32)
