"""Wan 2.2 text-to-video (``WanPipeline``, TI2V-5B layout): ``WanTransformer3DModel``,
``AutoencoderKLWan`` (the Wan2.2 residual VAE with 2x2 pixel patchification), UMT5 encoder.

As in the diffusers pipeline: prompts are whitespace-cleaned, tokenized to a fixed length,
the UMT5 last hidden state of the valid tokens is kept and the rest zeroed; video latents
``(C, (F - 1) / t + 1, H / s, W / s)``; the transformer takes ``timestep = 1000 sigma`` (per
token when the pipeline sets ``expand_timesteps``, as the TI2V model does) and predicts the
flow velocity; classic CFG with ``guidance_scale``. Sigmas: flow matching with a static shift
(``flow_shift`` 5.0 of the release).

Two-expert checkpoints (Wan2.2 A14B: ``transformer`` for high noise, ``transformer_2`` for
low noise, switched at ``boundary_ratio * 1000``) load as one trainable ``nn.ModuleDict``
``{"transformer": high, "transformer_2": low}``; each row of a batch goes to its expert by its
own sigma, LoRA wraps both experts, and exported names carry the expert prefix
(``transformer_2.blocks.0.attn1.to_q.lora_A.weight``), which is also how vllm-omni names the
two components. The low-noise expert uses the same guidance scale (the pipeline's default
for ``guidance_scale_2``). Not covered: image-to-video conditioning.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..base import module_dtype, register_adapter, write_adapter_options
from ..diffusion import DiffusionAdapter, latent_channel_stats, to_uint8
from ..tiny import register_tiny

__all__ = ["WAN_LORA_TARGETS", "Wan22Adapter", "build_tiny_wan22"]

WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


@register_adapter("WanPipeline", family="wan22")
class Wan22Adapter(DiffusionAdapter):
    """Wan 2.2 text-to-video adapter (single transformer)."""

    modality: ClassVar[str] = "video"
    cfg_param: ClassVar[str] = "guidance_scale"
    lora_target_modules: ClassVar[tuple[str, ...]] = WAN_LORA_TARGETS
    no_split_modules: ClassVar[tuple[str, ...]] = ("WanTransformerBlock",)
    shift: ClassVar[float] = 5.0

    @classmethod
    def load_components(cls, path: Path, **kwargs: Any) -> dict[str, Any]:
        index = json.loads((path / "model_index.json").read_text())
        comps = super().load_components(path, **kwargs)
        ratio = index.get("boundary_ratio")
        if "transformer_2" in comps:
            if ratio is None:
                raise ValueError(f"{path}: boundary_ratio: needed with transformer_2")
            comps["transformer"] = nn.ModuleDict(
                {"transformer": comps["transformer"], "transformer_2": comps.pop("transformer_2")}
            ).eval()
        comps["pipeline_config"] = {
            "expand_timesteps": bool(index.get("expand_timesteps", False)),
            "boundary_ratio": ratio,
        }
        return comps

    @property
    def experts(self) -> list[nn.Module]:
        """The denoising transformers: one, or (high-noise, low-noise) for A14B."""
        m = self.model
        return list(m.values()) if isinstance(m, nn.ModuleDict) else [m]

    @property
    def transformer_config(self) -> Any:
        return self.experts[0].config

    def enable_gradient_checkpointing(self) -> None:
        for e in self.experts:
            e.enable_gradient_checkpointing()

    # ---------------------------------------------------------------- text
    @property
    def max_text_length(self) -> int:
        """UMT5 tokens per prompt (option ``max_sequence_length``, default 512 as released)."""
        return int(self.options.get("max_sequence_length", 512))

    def encode_prompts(self, prompts: list[str], **inputs: Any) -> dict[str, Tensor]:
        """``prompt_embeds`` (B, L, D): UMT5 states of the valid tokens, zeros after."""
        tok = self.components["tokenizer"]
        enc = self.components["text_encoder"]
        texts = [" ".join(p.split()) for p in prompts]
        ids = tok(
            texts,
            padding="max_length",
            max_length=self.max_text_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        ).to(self.device)
        hidden = enc(ids.input_ids, ids.attention_mask).last_hidden_state.float()
        hidden = hidden * ids.attention_mask.unsqueeze(-1).to(hidden.dtype)
        return {"prompt_embeds": hidden}

    # -------------------------------------------------------------- latents
    def latent_shape(self, params: Any) -> tuple[int, ...]:
        """(C, (F - 1) / t + 1, H / s, W / s); F - 1 must be a multiple of the temporal factor
        t and H, W multiples of ``s * patch``."""
        cfg = self.component_config("vae")
        s, t = int(cfg.scale_factor_spatial), int(cfg.scale_factor_temporal)
        p = self.transformer_config.patch_size
        h, w, f = int(params.height), int(params.width), int(params.num_frames)
        if f < 1 or (f - 1) % t:
            raise ValueError(f"num_frames: {f} - 1 is not a multiple of {t}")
        for name, v, m in (("height", h, s * p[1]), ("width", w, s * p[2])):
            if v <= 0 or v % m:
                raise ValueError(f"{name}: {v} is not a positive multiple of {m}")
        return (int(self.transformer_config.in_channels), (f - 1) // t + 1, h // s, w // s)

    def _expert_forward(
        self, expert: nn.Module, latents: Tensor, sigma: Tensor, text: Tensor
    ) -> Tensor:
        dt = module_dtype(expert)
        t = sigma * 1000.0
        if self.components["pipeline_config"]["expand_timesteps"]:
            _, _, f, h, w = latents.shape
            p = expert.config.patch_size
            n_tokens = (f // p[0]) * (h // p[1]) * (w // p[2])
            t = t[:, None].expand(-1, n_tokens)
        return expert(
            hidden_states=latents.to(dt),
            timestep=t,
            encoder_hidden_states=text.to(dt),
            return_dict=False,
        )[0]

    def transformer_forward(
        self, latents: Tensor, sigma: Tensor, condition: dict[str, Tensor], params: Any
    ) -> Tensor:
        """``transformer(x, timestep=1000 sigma, text)``; with two experts each row goes to
        the high-noise expert when ``1000 sigma >= boundary_ratio * 1000``, else the low one."""
        text = condition["prompt_embeds"]
        experts = self.experts
        if len(experts) == 1:
            return self._expert_forward(experts[0], latents, sigma, text)
        cfg = self.components["scheduler"].config
        boundary = self.components["pipeline_config"]["boundary_ratio"] * cfg.num_train_timesteps
        high = sigma * 1000.0 >= boundary
        out = None
        for expert, rows in ((experts[0], high), (experts[1], ~high)):
            idx = rows.nonzero().flatten()
            if idx.numel() == 0:
                continue
            part = self._expert_forward(expert, latents[idx], sigma[idx], text[idx]).float()
            if out is None:
                out = latents.new_zeros(latents.shape, dtype=torch.float32)
            out = out.index_put((idx,), part)
        return out

    def vae_unscale(self, latents: Tensor) -> Tensor:
        """Model latents -> VAE latents: ``z * std + mean`` per channel."""
        mean, std = latent_channel_stats(self.component_config("vae"), latents)
        return latents * std + mean

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """(B, C, f, h, w) -> uint8 video (B, F, H, W, 3)."""
        vae = self.components["vae"]
        z = self.vae_unscale(latents.to(self.device, torch.float32)).to(vae.dtype)
        return to_uint8(vae.decode(z, return_dict=False)[0])


def _tiny_umt5(seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    from ..tokenizers_tiny import t5_tokenizer

    tok = t5_tokenizer(max_length=512)
    torch.manual_seed(seed)
    encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tok),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu",
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            decoder_start_token_id=0,
        )
    ).eval()
    return tok, encoder


def _tiny_wan_transformer(z: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=z,
        out_channels=z,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )


@register_tiny("wan22_a14b")
def build_tiny_wan22_a14b(path: Path, seed: int) -> None:
    """Tiny Wan2.2 A14B-shaped pipeline: two experts (2 blocks each, hidden 32) switched at
    ``boundary_ratio`` 0.875; the Wan2.1 VAE layout (z_dim 16, no pixel patches) with spatial
    factor 4 and temporal factor 2 (32 px x 5 frames -> latent 16 x 3 x 8 x 8); UMT5 d 32."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    tok, encoder = _tiny_umt5(seed)
    z = 16
    high, low = _tiny_wan_transformer(z), _tiny_wan_transformer(z)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=z,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True],
        scale_factor_spatial=4,
        scale_factor_temporal=2,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = WanPipeline(
        tokenizer=tok,
        text_encoder=encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=high,
        transformer_2=low,
        boundary_ratio=0.875,
    )
    pipe.save_pretrained(path, safe_serialization=True)
    write_adapter_options(path, max_sequence_length=16)


@register_tiny("wan22")
def build_tiny_wan22(path: Path, seed: int) -> None:
    """Tiny Wan2.2 TI2V-shaped pipeline: 2 blocks, hidden 32 (2 heads x 16), patch (1, 2, 2);
    residual VAE with z_dim 48, 2x2 pixel patches, spatial factor 8 and temporal factor 2
    (32 px x 5 frames -> latent 48 x 3 x 4 x 4); UMT5 encoder (d_model 32), 16 text tokens;
    flow-matching scheduler with shift 5."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    tok, encoder = _tiny_umt5(seed)
    z = 48
    transformer = _tiny_wan_transformer(z)
    vae = AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=z,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=8,
        scale_factor_temporal=2,
        latents_mean=[0.0] * z,
        latents_std=[1.0] * z,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    pipe = WanPipeline(
        tokenizer=tok,
        text_encoder=encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        expand_timesteps=True,
    )
    pipe.save_pretrained(path, safe_serialization=True)
    write_adapter_options(path, max_sequence_length=16)
