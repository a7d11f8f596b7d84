"""``clap``: audio-text agreement with CLAP (Wu et al. 2023, "Large-scale contrastive
language-audio pretraining"), through transformers `ClapModel` (extra ``clap``).

    a = f_audio(resample(x, sr -> model_sr)),  t = f_text(prompt)
    score = a . t / (||a|| ||t||)                  (cosine, in [-1, 1])

Inputs: ``audio`` (waveforms, channels averaged to mono), ``sample_rate``, ``prompts``.
The audio is resampled to the feature extractor's rate with band-limited (FFT) resampling.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .base import Reward, require_module
from .types import RewardInput, RewardOutput

__all__ = ["CLAPReward", "resample"]


def resample(wave: np.ndarray, orig_sr: int, new_sr: int) -> np.ndarray:
    """Band-limited resampling by zero-padding / truncating the real FFT spectrum."""
    if orig_sr == new_sr:
        return wave.astype(np.float32, copy=False)
    n = wave.shape[-1]
    m = max(1, round(n * new_sr / orig_sr))
    spec = np.fft.rfft(wave.astype(np.float64))
    k = m // 2 + 1
    if spec.shape[-1] >= k:
        spec = spec[..., :k]
    else:
        spec = np.concatenate([spec, np.zeros(k - spec.shape[-1], dtype=spec.dtype)])
    return (np.fft.irfft(spec, n=m) * (m / n)).astype(np.float32)


class CLAPReward(Reward):
    """Options: ``model`` (local path or hub id of a transformers ClapModel folder with its
    processor, ``model.safetensors`` read strictly; default ``laion/clap-htsat-unfused``),
    ``device``, ``batch_size``. ``details["cosine"]``."""

    name = "clap"
    default_batch_size = 16

    def __init__(
        self,
        model: str = "laion/clap-htsat-unfused",
        *,
        device: str = "cpu",
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, workers=workers)
        self.torch = require_module("torch", "clap", "clap")
        transformers = require_module("transformers", "clap", "clap")
        self.device = device
        from .clip import load_hf_model

        self.model = load_hf_model(transformers.ClapModel, model, "clap").eval().to(device)
        self.processor = transformers.ClapProcessor.from_pretrained(model)
        self.sampling_rate = int(self.processor.feature_extractor.sampling_rate)
        self.lock = threading.Lock()

    @staticmethod
    def _pooled(out: Any) -> Any:
        return out if hasattr(out, "norm") else out.pooler_output

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        waves = inp.audio_list(self.name)
        prompts = inp.prompt_list(self.name)
        sr = int(inp.sample_rate)  # type: ignore[arg-type]
        waves = [resample(w, sr, self.sampling_rate) for w in waves]
        torch = self.torch
        feats = self.processor.feature_extractor(
            waves, sampling_rate=self.sampling_rate, return_tensors="pt"
        )
        toks = self.processor.tokenizer(prompts, padding=True, truncation=True, return_tensors="pt")
        with self.lock, torch.no_grad():
            a = self._pooled(
                self.model.get_audio_features(**{k: v.to(self.device) for k, v in feats.items()})
            )
            t = self._pooled(
                self.model.get_text_features(**{k: v.to(self.device) for k, v in toks.items()})
            )
            cos = torch.nn.functional.cosine_similarity(a.float(), t.float(), dim=-1).cpu().numpy()
        return RewardOutput(cos, {"cosine": cos})
