from __future__ import annotations

import numpy as np
import pytest
from omni_rewards_testutils import save_tiny_clap

from omni_rewards import RewardInputError, load_reward
from omni_rewards.clap import resample

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_resample_keeps_a_tone():
    sr, f = 8000, 440.0
    t = np.arange(sr) / sr
    x = np.sin(2 * np.pi * f * t).astype(np.float32)
    y = resample(x, sr, 16000)
    assert y.shape == (16000,)
    t2 = np.arange(16000) / 16000
    np.testing.assert_allclose(y, np.sin(2 * np.pi * f * t2), atol=1e-3)


def test_clap_cosine_and_resampling(tmp_path):
    path = save_tiny_clap(tmp_path / "clap")
    r = load_reward("clap", model=path)
    rng = np.random.default_rng(0)
    audio16 = (0.1 * rng.standard_normal((2, 16000))).astype(np.float32)
    out = r(audio=audio16, sample_rate=16000, prompts=["a dog barks", "rain"])
    assert out.scores.shape == (2,) and np.all(np.abs(out.scores) <= 1 + 1e-6)
    # independent check through the transformers model and processor directly
    from transformers import ClapModel, ClapProcessor

    model, proc = ClapModel.from_pretrained(path).eval(), ClapProcessor.from_pretrained(path)
    with torch.no_grad():
        f = proc.feature_extractor(list(audio16), sampling_rate=16000, return_tensors="pt")
        a = model.get_audio_features(**f).pooler_output
        t = model.get_text_features(
            **proc.tokenizer(["a dog barks", "rain"], padding=True, return_tensors="pt")
        )
        ref = torch.nn.functional.cosine_similarity(a, t.pooler_output, dim=-1).numpy()
    np.testing.assert_allclose(out.scores, ref, atol=1e-5)
    # 8 kHz input is resampled to the model's 16 kHz: same score as resampling by hand
    audio8 = audio16[:, ::2].copy()
    by_hand = np.stack([resample(w, 8000, 16000) for w in audio8])
    np.testing.assert_allclose(
        r(audio=audio8, sample_rate=8000, prompts=["a dog barks", "rain"]).scores,
        r(audio=by_hand, sample_rate=16000, prompts=["a dog barks", "rain"]).scores,
        atol=1e-5,
    )
    with pytest.raises(RewardInputError, match="audio: clap needs `audio`"):
        r(prompts=["x"])
