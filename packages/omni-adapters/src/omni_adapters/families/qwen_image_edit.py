"""Qwen-Image-Edit (``QwenImageEditPipeline``): Qwen-Image conditioned on an input image.

The input image enters twice, as in the diffusers pipeline:
1. through the Qwen2.5-VL encoder: the chat template holds ``<|vision_start|><|image_pad|>
   <|vision_end|>`` before the instruction; the processor expands the pad token to the image's
   merged patch count and the vision tower fills them; the hidden states after the system
   prefix are the text condition (both CFG branches see the image);
2. as VAE latents: ``image_latents = (E(image) - mean) / std`` (argmax of the posterior),
   packed and concatenated after the noisy latents on the token axis; the transformer's RoPE
   gets both shapes, and the prediction is cropped to the noisy tokens.

``encode(prompts, negative_prompts=None, images=...)`` takes the condition images (uint8
``(B, H, W, 3)`` tensor / array, or a list of PIL images), resized to the adapter option
``condition_size`` (H, W).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..base import module_dtype, register_adapter, write_adapter_options
from ..diffusion import latent_channel_stats
from ..tiny import register_tiny
from .qwen_image import EDIT_TEMPLATE, QwenImageAdapter, pack, tiny_qwen_components, unpack

__all__ = [
    "EDIT_TEMPLATE",
    "QwenImageEditAdapter",
    "build_tiny_qwen_image_edit",
    "images_to_tensor",
    "tiny_qwen2vl_processor",
]


def images_to_tensor(images: Any, size: tuple[int, int]) -> Tensor:
    """uint8 ``(B, H, W, 3)`` tensor/array, or a list of PIL images / uint8 ``(H, W, 3)``
    arrays or tensors (sizes may differ), -> float ``(B, 3, h, w)`` in [0, 1], bilinearly
    resized to ``size`` (each row alone, so a row does not depend on the others)."""
    if isinstance(images, (list, tuple)):
        rows = [
            im.detach().cpu()
            if isinstance(im, Tensor)
            else torch.from_numpy(np.asarray(im.convert("RGB") if hasattr(im, "convert") else im))
            for im in images
        ]
        if rows and any(r.shape != rows[0].shape for r in rows):
            return torch.cat([images_to_tensor(r.unsqueeze(0), size) for r in rows])
        x = torch.stack(rows)
    else:
        x = torch.as_tensor(np.asarray(images) if not isinstance(images, Tensor) else images)
    if x.dim() != 4 or x.shape[-1] != 3:
        raise ValueError(f"images: expected (B, H, W, 3) uint8, got {tuple(x.shape)}")
    if x.dtype != torch.uint8:
        raise ValueError(f"images: expected uint8, got {x.dtype}")
    x = x.permute(0, 3, 1, 2).float() / 255.0
    if tuple(x.shape[-2:]) != tuple(size):
        x = torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return x.clamp(0, 1)


@register_adapter("QwenImageEditPipeline", family="qwen_image_edit")
class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit image-editing adapter (text + image -> image)."""

    prompt_template: ClassVar[str] = EDIT_TEMPLATE
    needs_images: ClassVar[bool] = True

    @property
    def condition_size(self) -> tuple[int, int]:
        """(H, W) the condition image is resized to (option ``condition_size``; default
        1024x1024, the release's target area for a square image)."""
        h, w = self.options.get("condition_size", (1024, 1024))
        f = 2 * self.vae_scale_factor
        if h % f or w % f:
            raise ValueError(f"condition_size: {(h, w)} must be multiples of {f}")
        return int(h), int(w)

    @property
    def vl_condition_size(self) -> tuple[int, int]:
        """(H, W) of the condition image the Qwen2.5-VL encoder sees: the same as
        :attr:`condition_size` here (the edit pipeline gives both paths one resized image)."""
        return self.condition_size

    #: the most condition images one request may carry
    max_condition_images: ClassVar[int] = 1

    def image_prompt(self, count: int) -> str:
        """Text put in front of the instruction for ``count`` condition images (the edit
        template already holds the one image's vision tokens)."""
        return ""

    @property
    def template_drop(self) -> int:
        """Template tokens before the user content (64 with the released tokenizer)."""
        tok = self.components["tokenizer"]
        prefix = self.prompt_template.split("{}")[0].split("<|vision_start|>")[0]
        return len(tok(prefix, add_special_tokens=False).input_ids)

    def condition_rows(self, images: Any) -> list[list[Tensor]]:
        """The condition images per row as uint8 ``(H, W, 3)`` tensors: a uint8 ``(B, H, W,
        3)`` tensor/array (one image per row), a ``(B, K, H, W, 3)`` one (K per row), or a
        list with, per row, one image or a list of images (PIL, arrays or tensors). Every row
        must carry the same number of images (they are stacked)."""
        if images is None:
            raise ValueError(f"images: {self.family} needs condition images (encode(..., images=))")
        if not isinstance(images, (list, tuple)):
            x = torch.as_tensor(np.asarray(images) if not isinstance(images, Tensor) else images)
            if x.dim() == 4:
                rows = [[r] for r in x]
            elif x.dim() == 5:
                rows = [list(r) for r in x]
            else:
                raise ValueError(f"images: expected (B, H, W, 3) uint8, got {tuple(x.shape)}")
        else:
            rows = [list(r) if isinstance(r, (list, tuple)) else [r] for r in images]
        counts = {len(r) for r in rows}
        if len(counts) > 1:
            raise ValueError(
                f"images: every row of a batch needs the same number of condition images, got "
                f"{sorted(counts)}"
            )
        k = counts.pop() if counts else 0
        if not 1 <= k <= self.max_condition_images:
            raise ValueError(
                f"images: {self.family} takes 1 to {self.max_condition_images} condition "
                f"image(s) per request, got {k}"
            )
        return rows

    def _resized(self, rows: list[list[Any]], size: tuple[int, int]) -> Tensor:
        """(B * K, 3, H, W) float in [0, 1], row-major (all images of row 0 first)."""
        return images_to_tensor([im for row in rows for im in row], size)

    def _images(self, images: Any) -> Tensor:
        return self._resized(self.condition_rows(images), self.condition_size)

    def encode_prompts(self, prompts: list[str], **inputs: Any) -> dict[str, Tensor]:
        """Instruction + condition image(s) through Qwen2.5-VL: ``prompt_embeds`` (B, L, D) and
        ``prompt_embeds_mask`` (B, L); L counts the image tokens too."""
        rows = self.condition_rows(inputs.get("images"))
        if len(rows) != len(prompts):
            raise ValueError(f"images: {len(rows)} rows of images for {len(prompts)} prompts")
        k = len(rows[0])
        img = self._resized(rows, self.vl_condition_size)
        proc = self.components["processor"]
        tok = self.components["tokenizer"]
        enc = self.components["text_encoder"]
        drop, length = self.template_drop, self.max_text_length
        texts = [self.prompt_template.format(self.image_prompt(k) + p) for p in prompts]
        model_inputs = proc(
            text=texts,
            images=list((img * 255).round().to(torch.uint8)),
            padding="max_length",
            max_length=drop + length,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        image_id = tok.convert_tokens_to_ids("<|image_pad|>")
        merge = proc.image_processor.merge_size**2
        expected = sum(int(t.prod()) // merge for t in model_inputs["image_grid_thw"][:k])
        got = int((model_inputs["input_ids"][0] == image_id).sum())
        if got != expected:
            raise ValueError(
                f"max_sequence_length: {length} text tokens cannot hold the {expected} image tokens"
            )
        out = enc(
            input_ids=model_inputs["input_ids"],
            attention_mask=model_inputs["attention_mask"],
            pixel_values=model_inputs["pixel_values"].to(enc.dtype),
            image_grid_thw=model_inputs["image_grid_thw"],
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1].float()
        mask_in = model_inputs["attention_mask"].bool()
        embeds = hidden.new_zeros(len(texts), length, hidden.shape[-1])
        mask = torch.zeros(len(texts), length, dtype=torch.long, device=hidden.device)
        for i in range(len(texts)):
            valid = hidden[i][mask_in[i]][drop:]
            embeds[i, : valid.shape[0]] = valid
            mask[i, : valid.shape[0]] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def encode_shared(self, **inputs: Any) -> dict[str, Tensor]:
        """``image_latents``: normalised VAE posterior mode of the condition image, (B, z_dim,
        h', w') for one image per row, (B, K, z_dim, h', w') for K (Edit-Plus)."""
        unknown = set(inputs) - {"images"}
        if unknown:
            raise TypeError(f"encode: unexpected inputs {sorted(unknown)}")
        rows = self.condition_rows(inputs.get("images"))
        img = self._resized(rows, self.condition_size).to(self.device)
        vae = self.components["vae"]
        x = (img * 2 - 1).unsqueeze(2).to(vae.dtype)
        z = vae.encode(x).latent_dist.mode()[:, :, 0].float()
        mean, std = latent_channel_stats(vae.config, z)
        z = (z - mean) / std
        if self.max_condition_images == 1:
            return {"image_latents": z}
        return {"image_latents": z.reshape(len(rows), len(rows[0]), *z.shape[1:])}

    def transformer_forward(
        self, latents: Tensor, sigma: Tensor, condition: dict[str, Tensor], params: Any
    ) -> Tensor:
        """Noisy tokens, then each condition image's tokens, on one axis (the pipeline's
        ``torch.cat([latents, image_latents], dim=1)``); output cropped to the noisy ones."""
        b, _, h, w = latents.shape
        cond = condition["image_latents"]
        if cond.dim() == 4:
            cond = cond.unsqueeze(1)
        ch, cw = cond.shape[-2:]
        x = pack(latents)
        parts = [x] + [pack(cond[:, i].to(latents.dtype)) for i in range(cond.shape[1])]
        tokens = torch.cat(parts, dim=1)
        dt = module_dtype(self.model)
        shapes = [(1, h // 2, w // 2)] + [(1, ch // 2, cw // 2)] * cond.shape[1]
        out = self.model(
            hidden_states=tokens.to(dt),
            encoder_hidden_states=condition["prompt_embeds"].to(dt),
            encoder_hidden_states_mask=condition["prompt_embeds_mask"],
            timestep=sigma.to(dt),
            img_shapes=[shapes] * b,
            return_dict=False,
        )[0]
        return unpack(out[:, : x.shape[1]], h, w)


def tiny_qwen2vl_processor(tokenizer: Any) -> Any:
    """The edit pipelines' ``Qwen2VLProcessor`` at tiny size: patch 4, merge 2 (a 32 px image
    is 16 vision tokens, a 16 px one 4), 8x8 to 64x64 pixels."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    kw = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2}
    kw.update(min_pixels=8 * 8, max_pixels=64 * 64)
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**kw),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**kw),
    )


@register_tiny("qwen_image_edit")
def build_tiny_qwen_image_edit(path: Path, seed: int) -> None:
    """Tiny Qwen-Image-Edit folder: the tiny Qwen-Image components plus a ``Qwen2VLProcessor``
    (patch 4, merge 2: a 32 px image is 16 vision tokens); condition size 32x32, 48 text tokens
    (16 image + 32 text)."""
    from diffusers import QwenImageEditPipeline

    comps = tiny_qwen_components(seed)
    processor = tiny_qwen2vl_processor(comps["tokenizer"])
    QwenImageEditPipeline(processor=processor, **comps).save_pretrained(
        path, safe_serialization=True
    )
    write_adapter_options(path, max_sequence_length=48, condition_size=[32, 32])
