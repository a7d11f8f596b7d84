"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): MMDiT + CLIP-L + CLIP-G + T5.

Text conditioning, as in the diffusers pipeline: each CLIP gives its penultimate hidden
states and its projected pooled output; the two CLIP sequences are concatenated on the
feature axis, zero-padded to T5's width and stacked before the T5 sequence on the token axis;
the pooled outputs are concatenated. The transformer takes ``timestep = 1000 sigma`` and
predicts the flow velocity ``eps - x0``. Scheduler: flow-matching Euler, static shift 3.0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..base import module_dtype, register_adapter
from ..diffusion import DiffusionAdapter
from ..tiny import register_tiny

__all__ = ["SD3Adapter", "build_tiny_sd3"]

#: attention projections of the joint blocks (image stream, text stream ``add_*``, and the
#: SD3.5 dual-attention ``attn2`` which matches the same suffixes)
SD3_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)


@register_adapter("StableDiffusion3Pipeline", family="sd3")
class SD3Adapter(DiffusionAdapter):
    """SD3/SD3.5 text-to-image adapter."""

    modality: ClassVar[str] = "image"
    cfg_param: ClassVar[str] = "guidance_scale"
    lora_target_modules: ClassVar[tuple[str, ...]] = SD3_LORA_TARGETS
    no_split_modules: ClassVar[tuple[str, ...]] = ("JointTransformerBlock",)
    shift: ClassVar[float] = 3.0

    # ---------------------------------------------------------------- text
    @property
    def clip_max_length(self) -> int:
        return int(self.components["tokenizer"].model_max_length)

    @property
    def t5_max_length(self) -> int:
        """T5 tokens per prompt: option ``max_sequence_length``, default min(256, tokenizer max)."""
        tok = self.components.get("tokenizer_3")
        default = 256 if tok is None else min(256, int(tok.model_max_length))
        return int(self.options.get("max_sequence_length", default))

    def _clip(self, prompts: list[str], idx: str) -> tuple[Tensor, Tensor]:
        tok = self.components["tokenizer" + idx]
        enc = self.components["text_encoder" + idx]
        ids = tok(
            prompts,
            padding="max_length",
            max_length=self.clip_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids.to(self.device)
        out = enc(ids, output_hidden_states=True)
        return out.hidden_states[-2].float(), out.text_embeds.float()

    def encode_prompts(self, prompts: list[str], **inputs: Any) -> dict[str, Tensor]:
        """``prompt_embeds`` (B, L_clip + L_t5, joint_dim) and ``pooled_prompt_embeds``
        (B, pooled_dim), both float32."""
        h1, p1 = self._clip(prompts, "")
        h2, p2 = self._clip(prompts, "_2")
        clip = torch.cat([h1, h2], dim=-1)
        joint = int(self.model.config.joint_attention_dim)
        if "text_encoder_3" in self.components:
            tok = self.components["tokenizer_3"]
            ids = tok(
                prompts,
                padding="max_length",
                max_length=self.t5_max_length,
                truncation=True,
                add_special_tokens=True,
                return_tensors="pt",
            ).input_ids.to(self.device)
            t5 = self.components["text_encoder_3"](ids)[0].float()
        else:  # SD3 without T5: zeros, as in the pipeline
            t5 = torch.zeros(len(prompts), self.t5_max_length, joint, device=self.device)
        if clip.shape[-1] > joint:
            raise ValueError(f"CLIP width {clip.shape[-1]} exceeds joint_attention_dim {joint}")
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {
            "prompt_embeds": torch.cat([clip, t5], dim=-2),
            "pooled_prompt_embeds": torch.cat([p1, p2], dim=-1),
        }

    # -------------------------------------------------------------- latents
    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.component_config("vae").block_out_channels) - 1)

    def latent_shape(self, params: Any) -> tuple[int, ...]:
        """(C, H / f, W / f); H and W must be multiples of ``f * patch_size``."""
        f = self.vae_scale_factor
        p = int(self.model.config.patch_size)
        h, w = int(params.height), int(params.width)
        for name, v in (("height", h), ("width", w)):
            if v <= 0 or v % (f * p):
                raise ValueError(f"{name}: {v} is not a positive multiple of {f * p}")
        return (int(self.model.config.in_channels), h // f, w // f)

    def transformer_forward(
        self, latents: Tensor, sigma: Tensor, condition: dict[str, Tensor], params: Any
    ) -> Tensor:
        """``transformer(x, prompt_embeds, pooled, timestep=1000 sigma)``."""
        dt = module_dtype(self.model)
        return self.model(
            hidden_states=latents.to(dt),
            encoder_hidden_states=condition["prompt_embeds"].to(dt),
            pooled_projections=condition["pooled_prompt_embeds"].to(dt),
            timestep=(sigma * 1000.0).to(dt),
            return_dict=False,
        )[0]


# ------------------------------------------------------------------ tiny build
TINY_SD3 = {
    "clip_hidden": (16, 24),
    "t5_d_model": 48,
    "heads": 2,
    "head_dim": 16,
    "layers": 2,
    "latent_channels": 16,
    "vae_blocks": (8, 16, 16),
    "text_len": 16,
}


@register_tiny("sd3")
def build_tiny_sd3(path: Path, seed: int) -> None:
    """Tiny SD3.5-medium-shaped pipeline: 2 MMDiT blocks (block 0 with dual attention, RMS
    qk-norm), hidden 32, patch 2; 16-channel VAE with scale factor 4 (32 px -> 8x8 latent);
    CLIP-L/CLIP-G (hidden 16/24) and T5 (d_model 48, gated-GELU), 16 text tokens each."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    from ..tokenizers_tiny import clip_tokenizer, t5_tokenizer

    c = TINY_SD3
    torch.manual_seed(seed)
    tok1 = clip_tokenizer(c["text_len"])
    tok2 = clip_tokenizer(c["text_len"])
    tok3 = t5_tokenizer(c["text_len"])
    encoders = []
    for hidden in c["clip_hidden"]:
        cfg = CLIPTextConfig(
            vocab_size=len(tok1),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=c["text_len"],
            projection_dim=hidden,
            hidden_act="gelu",
            bos_token_id=tok1.bos_token_id,
            eos_token_id=tok1.eos_token_id,
            pad_token_id=tok1.pad_token_id,
        )
        encoders.append(CLIPTextModelWithProjection(cfg).eval())
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tok3),
            d_model=c["t5_d_model"],
            d_kv=8,
            d_ff=2 * c["t5_d_model"],
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu",
            pad_token_id=tok3.pad_token_id,
            eos_token_id=tok3.eos_token_id,
            decoder_start_token_id=0,
        )
    ).eval()
    pooled = sum(c["clip_hidden"])
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=c["latent_channels"],
        num_layers=c["layers"],
        attention_head_dim=c["head_dim"],
        num_attention_heads=c["heads"],
        joint_attention_dim=c["t5_d_model"],
        caption_projection_dim=c["heads"] * c["head_dim"],
        pooled_projection_dim=pooled,
        out_channels=c["latent_channels"],
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )
    blocks = c["vae_blocks"]
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(blocks),
        up_block_types=("UpDecoderBlock2D",) * len(blocks),
        block_out_channels=blocks,
        layers_per_block=1,
        latent_channels=c["latent_channels"],
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=encoders[0],
        tokenizer=tok1,
        text_encoder_2=encoders[1],
        tokenizer_2=tok2,
        text_encoder_3=t5,
        tokenizer_3=tok3,
    )
    pipe.save_pretrained(path, safe_serialization=True)
