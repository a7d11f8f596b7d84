"""``loudness``: louder waveforms score higher, the mapping is exact, bad input is named."""

from __future__ import annotations

import numpy as np
import pytest

from omni_rewards import RewardInput, RewardInputError, load_reward
from omni_rewards.audio import rms_dbfs


def test_loudness_orders_by_level_and_matches_the_formula() -> None:
    t = np.arange(16000) / 16000
    tone = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    waves = np.stack([tone * a for a in (1e-4, 1e-2, 0.5)])  # quiet -> loud
    out = load_reward("loudness")(RewardInput(audio=waves, sample_rate=16000))
    assert np.all(np.diff(out.scores) > 0)
    # a full-scale sine has RMS 1/sqrt(2): -3.01 dBFS; at 0.5 amplitude -9.03 dBFS
    assert rms_dbfs(tone * 0.5) == pytest.approx(-9.03, abs=0.01)
    assert out.scores[2] == pytest.approx((-9.03 + 60) / 60, abs=1e-3)
    assert out.details["dbfs"][0] == pytest.approx(-83.0, abs=0.1)
    assert out.scores[0] == 0.0  # below the floor: clipped


def test_loudness_mixes_channels_and_rejects_bad_input() -> None:
    stereo = np.full((1, 2, 800), 0.1, dtype=np.float32)
    out = load_reward("loudness", floor_db=-40)(RewardInput(audio=stereo, sample_rate=8000))
    assert out.scores[0] == pytest.approx((-20 + 40) / 40, abs=1e-4)
    with pytest.raises(ValueError, match="floor_db"):
        load_reward("loudness", floor_db=3)
    with pytest.raises(RewardInputError, match="audio"):
        load_reward("loudness")(RewardInput(images=np.zeros((1, 4, 4, 3), np.uint8)))
