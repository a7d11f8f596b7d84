"""Qwen-Image-Edit-Plus (``QwenImageEditPlusPipeline``: Qwen-Image-Edit-2509 / -2511): image
editing conditioned on several images per request.

As in the diffusers pipeline (``pipeline_qwenimage_edit_plus.py``):

- the Qwen2.5-VL encoder reads ``Picture 1: <|vision_start|><|image_pad|><|vision_end|>
  Picture 2: ...`` then the instruction, inside the edit system template; each condition image
  is resized for it to about 384 x 384 pixels (``CONDITION_IMAGE_SIZE``; option
  ``vl_condition_size``); the hidden states after the 64 template tokens are the condition;
- each condition image is also VAE-encoded at about 1024 x 1024 (``VAE_IMAGE_SIZE``; option
  ``condition_size``), normalised, packed, and the K image token blocks follow the noisy
  tokens on one axis; the transformer's RoPE gets every shape
  (``img_shapes = [(1, h, w), (1, h1, w1), ...]``) and the prediction is cropped to the
  noisy tokens.

Every request of a batch carries the same number K of condition images (the rollout engine
only batches requests with equal K); images are resized to the fixed option sizes, so rows
stack (the pipeline instead keeps each image's aspect ratio at the target area).
``encode(prompts, images=...)`` takes, per row, one image or a list of K images (uint8
``(H, W, 3)``), or a uint8 ``(B, K, H, W, 3)`` tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from ..base import register_adapter, write_adapter_options
from ..tiny import register_tiny
from .qwen_image import tiny_qwen_components
from .qwen_image_edit import EDIT_TEMPLATE, QwenImageEditAdapter, tiny_qwen2vl_processor

__all__ = ["EDIT_PLUS_TEMPLATE", "QwenImageEditPlusAdapter", "build_tiny_qwen_image_edit_plus"]

#: the edit system template with the user content (image prompts + instruction) in ``{}``
EDIT_PLUS_TEMPLATE = EDIT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>{}", "{}")
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


@register_adapter("QwenImageEditPlusPipeline", family="qwen_image_edit_plus")
class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """Qwen-Image-Edit-2509/2511 adapter (text + K images -> image)."""

    prompt_template: ClassVar[str] = EDIT_PLUS_TEMPLATE
    #: the pipeline documents up to 3 input images for 2509; more work, at sequence cost
    max_condition_images: ClassVar[int] = 8

    @property
    def vl_condition_size(self) -> tuple[int, int]:
        """(H, W) each condition image has for the Qwen2.5-VL encoder (option
        ``vl_condition_size``, default 384 x 384: the pipeline's ``CONDITION_IMAGE_SIZE`` area
        for a square image)."""
        h, w = self.options.get("vl_condition_size", (384, 384))
        return int(h), int(w)

    def image_prompt(self, count: int) -> str:
        return "".join(PICTURE.format(i + 1) for i in range(count))


@register_tiny("qwen_image_edit_plus")
def build_tiny_qwen_image_edit_plus(path: Path, seed: int) -> None:
    """Tiny Qwen-Image-Edit-Plus folder: the tiny Qwen-Image components (``zero_cond_t`` as
    2511 sets it) plus a ``Qwen2VLProcessor`` (patch 4, merge 2: a 16 px VL image is 4 vision
    tokens); condition size 32 x 32 for the VAE, 16 x 16 for the VL encoder; 64 text tokens
    (room for 2 images and the ``Picture i:`` prompts)."""
    from diffusers import QwenImageEditPlusPipeline

    comps = tiny_qwen_components(seed, zero_cond_t=True)
    processor = tiny_qwen2vl_processor(comps["tokenizer"])
    QwenImageEditPlusPipeline(processor=processor, **comps).save_pretrained(
        path, safe_serialization=True
    )
    write_adapter_options(
        path, max_sequence_length=64, condition_size=[32, 32], vl_condition_size=[16, 16]
    )
