"""Approximate sizes of the model-based rewards as they load by default, for memory planning
(``omni-train validate --memory``): parameters, bytes per parameter, and where the count comes
from. Rule-based rewards (``ocr`` runs ONNX models on the CPU, ``math``, ``brightness``...)
take no GPU memory and are not listed."""

from __future__ import annotations

__all__ = ["REWARD_MODEL_SIZES", "reward_bytes"]

#: reward name -> (parameters, bytes per parameter as loaded, source)
REWARD_MODEL_SIZES: dict[str, tuple[float, int, str]] = {
    "pickscore": (986e6, 4, "CLIP ViT-H/14 (yuvalkirstain/PickScore_v1), ~986M, float32"),
    "hpsv2": (986e6, 4, "open_clip ViT-H-14 (HPS v2.1), ~986M, float32"),
    "clip_score": (428e6, 4, "CLIP ViT-L/14 (openai/clip-vit-large-patch14), ~428M, float32"),
    "aesthetic": (428e6, 4, "CLIP ViT-L/14 + the LAION aesthetic MLP, ~428M, float32"),
    "clap": (154e6, 4, "laion/clap-htsat-unfused, ~154M, float32"),
    "imagebind": (1.07e9, 4, "ImageBind-Huge vision + text + audio towers, ~1.07B, float32"),
    "dina_lrm": (
        6.8e9,
        2,
        "DiNa-LRM: 12 of SD3.5-Medium's 24 blocks + head (~1.2B) with SD3.5's CLIP-L/G + T5-XXL "
        "text encoders (~5.6B), bfloat16",
    ),
}


def reward_bytes(name: str) -> float:
    """Bytes the named reward's model takes as loaded (0 for rule-based rewards)."""
    params, per, _ = REWARD_MODEL_SIZES.get(name, (0.0, 0, ""))
    return float(params) * per
