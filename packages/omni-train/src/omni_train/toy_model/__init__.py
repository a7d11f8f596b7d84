"""The toy SD3 of the shapes world, shipped with omni-train (docs/toy_world.md).

``SHAPES_SD3`` is a ``StableDiffusion3Pipeline`` folder (safetensors) written by
``omni-train pretrain shapes_sd3`` (the config `omni_train/pretrain_configs/shapes_sd3.yaml`,
whose ``train.steps`` it was trained for); load it with
``omni_adapters.from_pretrained(SHAPES_SD3)``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SHAPES_SD3"]

#: the pretrained toy SD3 (a diffusers pipeline folder)
SHAPES_SD3 = Path(__file__).parent / "shapes_sd3"
