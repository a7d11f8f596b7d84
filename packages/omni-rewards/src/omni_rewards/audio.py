"""Weight-free audio rewards (numpy only), the audio counterpart of ``brightness``.

``loudness``: the RMS level of the (mono-mixed) waveform in dBFS, mapped linearly to [0, 1]
over ``[floor_db, 0]``:

    rms   = sqrt(mean(x^2))
    level = 20 log10(max(rms, 1e-10))                (dBFS; 0 dB is a full-scale square wave)
    score = clip((level - floor_db) / -floor_db, 0, 1)

Useful for checking an audio training loop on tiny random models, whose decoders cannot make
anything CLAP or ImageBind would recognise. Inputs: ``audio`` and ``sample_rate``.
"""

from __future__ import annotations

import numpy as np

from .base import Reward
from .registry import register
from .types import RewardInput, RewardOutput

__all__ = ["LoudnessReward", "rms_dbfs"]


def rms_dbfs(waveform: np.ndarray) -> float:
    """RMS level of a mono waveform in dBFS (floored at -200 dB for silence)."""
    rms = float(np.sqrt(np.mean(np.square(waveform, dtype=np.float64))))
    return 20.0 * np.log10(max(rms, 1e-10))


@register("loudness")
class LoudnessReward(Reward):
    """score = clip((RMS dBFS - floor_db) / -floor_db, 0, 1). Option ``floor_db`` (< 0, default
    -60). ``details["dbfs"]`` is each waveform's level. Inputs: ``audio``, ``sample_rate``."""

    name = "loudness"

    def __init__(self, floor_db: float = -60.0, *, batch_size: int | None = None, workers: int = 1):
        super().__init__(batch_size=batch_size, workers=workers)
        if not floor_db < 0:
            raise ValueError(f"floor_db: must be < 0 dB, got {floor_db}")
        self.floor_db = float(floor_db)

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        levels = np.array([rms_dbfs(w) for w in inp.audio_list(self.name)], dtype=np.float64)
        scores = np.clip((levels - self.floor_db) / -self.floor_db, 0.0, 1.0)
        return RewardOutput(scores.astype(np.float32), details={"dbfs": levels})
