"""``imagebind``: text / audio / video agreement in ImageBind's joint space (Girdhar et al. 2023,
"ImageBind: One Embedding Space To Bind Them All"), extra ``imagebind``.

With unit embeddings t = E_text(prompt), a = E_audio(audio), v = E_vision(video):

    audio_video = a . v,   text_audio = t . a,   text_video = t . v
    all         = 0.5 * a.v + 0.25 * t.a + 0.25 * t.v

``mode`` picks one (default ``all``); every cosine is in ``details``.

The encoder is anything with the `ImageBindEncoder` interface (``embed_text``, ``embed_audio``,
``embed_video``), e.g. a wrapper around the official package. `ImageBindModel` is a compact
ImageBind-style model (`build_imagebind`) of the vision / text / audio towers whose parameter names follow the
released checkpoint (``modality_preprocessors.*``, ``modality_trunks.*``, ``modality_heads.*``,
``modality_postprocessors.*``, as in facebookresearch/ImageBind ``imagebind_model.py``);
`load_imagebind` reads a directory with ``config.json`` + ``model.safetensors``. The released
``imagebind_huge.pth`` is a torch pickle: ``omni-rewards convert imagebind`` turns it into
that directory once (``torch.load(weights_only=True)``, only in that command), dropping the
depth / thermal / IMU towers by name. Preprocessing follows the paper:
video as 2-frame clips at 224 px with CLIP normalisation; audio as 16 kHz log-mel (128 bins,
25 ms window, 10 ms hop, 204 frames per clip, normalised with mean -4.268 / std 9.138).
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .base import Reward, require_module
from .clap import resample
from .clip import OPENAI_MEAN, OPENAI_STD, clip_preprocess, load_state_dict
from .types import RewardInput, RewardInputError, RewardOutput

__all__ = [
    "IMAGEBIND_HUGE",
    "ImageBindConfig",
    "ImageBindEncoder",
    "ImageBindReward",
    "TorchImageBindEncoder",
    "TowerConfig",
    "build_imagebind",
    "check_state",
    "load_imagebind",
    "save_imagebind",
]

MODES = ("audio_video", "text_audio", "text_video", "all")


class ImageBindEncoder(Protocol):
    """What `ImageBindReward` needs; each returns unit-norm float arrays (B, D)."""

    def embed_text(self, texts: list[str]) -> np.ndarray: ...

    def embed_audio(self, waves: list[np.ndarray], sample_rate: int) -> np.ndarray: ...

    def embed_video(self, videos: list[np.ndarray]) -> np.ndarray: ...


@dataclass
class TowerConfig:
    width: int
    layers: int
    heads: int
    add_bias_kv: bool = False


@dataclass
class ImageBindConfig:
    embed_dim: int = 1024
    vision: TowerConfig = field(default_factory=lambda: TowerConfig(1280, 32, 16))
    text: TowerConfig = field(default_factory=lambda: TowerConfig(1024, 24, 16))
    audio: TowerConfig = field(default_factory=lambda: TowerConfig(768, 12, 12, add_bias_kv=True))
    image_size: int = 224
    patch_size: int = 14
    clip_frames: int = 2
    vocab_size: int = 49408
    context_length: int = 77
    mel_bins: int = 128
    audio_frames: int = 204
    audio_patch: int = 16
    audio_stride: int = 10
    audio_sample_rate: int = 16000
    audio_clip_seconds: float = 2.0
    audio_logit_scale: float = 20.0

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ImageBindConfig:
        d = dict(d)
        d.pop("type", None)
        for k in ("vision", "text", "audio"):
            if k in d and isinstance(d[k], dict):
                d[k] = TowerConfig(**d[k])
        return ImageBindConfig(**d)


#: The released imagebind_huge architecture.
IMAGEBIND_HUGE = ImageBindConfig()


def _mel_filterbank(n_fft: int, sr: int, n_mels: int) -> np.ndarray:
    """HTK-style triangular mel filters, (n_mels, n_fft // 2 + 1)."""

    def hz_to_mel(f: np.ndarray | float) -> Any:
        return 1127.0 * np.log1p(np.asarray(f) / 700.0)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        return 700.0 * (np.exp(m / 1127.0) - 1.0)

    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mels = np.linspace(hz_to_mel(20.0), hz_to_mel(sr / 2), n_mels + 2)
    hz = mel_to_hz(mels)
    fb = np.zeros((n_mels, len(freqs)), dtype=np.float32)
    for i in range(n_mels):
        lo, c, hi = hz[i], hz[i + 1], hz[i + 2]
        up = (freqs - lo) / max(c - lo, 1e-9)
        down = (hi - freqs) / max(hi - c, 1e-9)
        fb[i] = np.maximum(0.0, np.minimum(up, down))
    return fb


def build_imagebind(cfg: ImageBindConfig) -> Any:
    """`ImageBindModel` (a torch module) for ``cfg``."""
    torch = require_module("torch", "imagebind", "imagebind")
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, t: TowerConfig) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(
                t.width, t.heads, add_bias_kv=t.add_bias_kv, batch_first=False
            )
            self.norm_1 = nn.LayerNorm(t.width, eps=1e-6)
            self.mlp = nn.Sequential()
            self.mlp.fc1 = nn.Linear(t.width, 4 * t.width)
            self.mlp.act = nn.GELU()
            self.mlp.fc2 = nn.Linear(4 * t.width, t.width)
            self.norm_2 = nn.LayerNorm(t.width, eps=1e-6)

        def forward(self, x: Any, mask: Any = None) -> Any:  # x: (L, B, D)
            h = self.norm_1(x)
            x = x + self.attn(h, h, h, need_weights=False, attn_mask=mask)[0]
            return x + self.mlp(self.norm_2(x))

    class Trunk(nn.Module):
        def __init__(self, t: TowerConfig, ln_pre: bool) -> None:
            super().__init__()
            self.pre_transformer_layer = nn.Sequential(
                nn.LayerNorm(t.width, eps=1e-6) if ln_pre else nn.Identity()
            )
            self.blocks = nn.ModuleList([Block(t) for _ in range(t.layers)])

        def forward(self, x: Any, mask: Any = None) -> Any:  # (B, L, D)
            x = self.pre_transformer_layer(x).transpose(0, 1)
            for b in self.blocks:
                x = b(x, mask)
            return x.transpose(0, 1)

    class Stem(nn.Module):
        # the official PatchEmbedGeneric: a one-layer stem is the layer itself (audio:
        # ``rgbt_stem.proj.weight``), a longer one a Sequential (vision: ``proj.1.weight``)
        def __init__(self, layers: list[Any], norm: Any = None) -> None:
            super().__init__()
            self.proj = layers[0] if len(layers) == 1 else nn.Sequential(*layers)
            if norm is not None:
                self.norm_layer = norm

        def forward(self, x: Any) -> Any:
            x = self.proj(x).flatten(2).transpose(1, 2)
            return self.norm_layer(x) if hasattr(self, "norm_layer") else x

    class PosHelper(nn.Module):
        def __init__(self, n: int, d: int) -> None:
            super().__init__()
            self.pos_embed = nn.Parameter(torch.zeros(1, n, d))

    class VisionPre(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w, p, f = cfg.vision.width, cfg.patch_size, cfg.clip_frames
            self.rgbt_stem = Stem(
                [nn.Identity(), nn.Conv3d(3, w, (f, p, p), stride=(f, p, p), bias=False)]
            )
            n = (cfg.image_size // p) ** 2
            self.pos_embedding_helper = PosHelper(n + 1, w)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, w))

        def forward(self, x: Any) -> Any:  # (B, 3, T, H, W)
            x = self.rgbt_stem(x)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
            return x + self.pos_embedding_helper.pos_embed

    class AudioPre(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = cfg.audio.width
            conv = nn.Conv2d(1, w, cfg.audio_patch, stride=cfg.audio_stride, bias=False)
            self.rgbt_stem = Stem([conv], nn.LayerNorm(w))
            hh = (cfg.mel_bins - cfg.audio_patch) // cfg.audio_stride + 1
            ww = (cfg.audio_frames - cfg.audio_patch) // cfg.audio_stride + 1
            self.pos_embedding_helper = PosHelper(hh * ww + 1, w)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, w))

        def forward(self, x: Any) -> Any:  # (B, 1, mel, frames)
            x = self.rgbt_stem(x)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
            return x + self.pos_embedding_helper.pos_embed

    class TextPre(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = cfg.text.width
            self.token_embedding = nn.Embedding(cfg.vocab_size, w)
            self.pos_embed = nn.Parameter(torch.zeros(1, cfg.context_length, w))
            mask = torch.full((cfg.context_length, cfg.context_length), float("-inf")).triu(1)
            self.register_buffer("mask", mask)

        def forward(self, tokens: Any) -> Any:
            return self.token_embedding(tokens) + self.pos_embed[:, : tokens.shape[1]]

    class Scale(nn.Module):
        # LearnableLogitScaling: a scalar log scale (a parameter for text, a buffer for audio)
        def __init__(self, init: float, learnable: bool) -> None:
            super().__init__()
            v = torch.tensor(math.log(init))
            if learnable:
                self.log_logit_scale = nn.Parameter(v)
            else:
                self.register_buffer("log_logit_scale", v)

    class SelectEOSAndProject(nn.Module):
        def __init__(self, w: int, d: int) -> None:
            super().__init__()
            self.proj = nn.Sequential(nn.LayerNorm(w, eps=1e-6), nn.Linear(w, d, bias=False))

    class ImageBindModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = cfg
            d = cfg.embed_dim
            self.modality_preprocessors = nn.ModuleDict(
                {"vision": VisionPre(), "text": TextPre(), "audio": AudioPre()}
            )
            self.modality_trunks = nn.ModuleDict(
                {
                    "vision": Trunk(cfg.vision, True),
                    "text": Trunk(cfg.text, False),
                    "audio": Trunk(cfg.audio, False),
                }
            )

            def head(w: int) -> Any:
                return nn.Sequential(
                    nn.LayerNorm(w, eps=1e-6), nn.Identity(), nn.Linear(w, d, bias=False)
                )

            self.modality_heads = nn.ModuleDict(
                {
                    "vision": head(cfg.vision.width),
                    "text": SelectEOSAndProject(cfg.text.width, d),
                    "audio": head(cfg.audio.width),
                }
            )
            self.modality_postprocessors = nn.ModuleDict(
                {
                    "vision": nn.Identity(),
                    "text": nn.Sequential(nn.Identity(), Scale(1 / 0.07, True)),
                    "audio": nn.Sequential(nn.Identity(), Scale(cfg.audio_logit_scale, False)),
                }
            )

        def encode_vision(self, clips: Any) -> Any:
            x = self.modality_trunks["vision"](self.modality_preprocessors["vision"](clips))
            return nn.functional.normalize(self.modality_heads["vision"](x[:, 0]), dim=-1)

        def encode_audio(self, mels: Any) -> Any:
            x = self.modality_trunks["audio"](self.modality_preprocessors["audio"](mels))
            return nn.functional.normalize(self.modality_heads["audio"](x[:, 0]), dim=-1)

        def encode_text(self, tokens: Any, eos_index: Any) -> Any:
            pre = self.modality_preprocessors["text"]
            n = tokens.shape[1]
            x = self.modality_trunks["text"](pre(tokens), pre.mask[:n, :n])
            x = x[torch.arange(x.shape[0]), eos_index]
            return nn.functional.normalize(self.modality_heads["text"].proj(x), dim=-1)

    return ImageBindModel()


class _ByteTokenizer:
    """Fallback text tokenizer (bytes + 3, SOT = 1, EOT = 2) when open_clip's BPE is absent;
    only meaningful for checkpoints trained with it (tests, custom encoders)."""

    def __init__(self, context_length: int, vocab_size: int) -> None:
        self.context_length, self.vocab_size = context_length, vocab_size

    def __call__(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.context_length), dtype=np.int64)
        for i, t in enumerate(texts):
            ids = [
                1,
                *[min(b + 3, self.vocab_size - 1) for b in t.encode()][: self.context_length - 2],
                2,
            ]
            out[i, : len(ids)] = ids
        return out


class TorchImageBindEncoder:
    """`ImageBindEncoder` over an `ImageBindModel`, with ImageBind's preprocessing."""

    def __init__(
        self, model: Any, *, tokenizer: Any = None, device: str = "cpu", clips_per_video: int = 2
    ):
        self.torch = require_module("torch", "imagebind", "imagebind")
        self.model = model.eval().to(device)
        self.cfg: ImageBindConfig = model.config
        self.device = device
        self.clips_per_video = int(clips_per_video)
        if tokenizer is None and self.cfg.vocab_size >= 49408:
            try:  # ImageBind's text tokenizer is CLIP's BPE, which open_clip ships
                import open_clip

                tokenizer = open_clip.SimpleTokenizer(context_length=self.cfg.context_length)
            except ImportError as e:
                raise ImportError(
                    "imagebind: the text tokenizer (CLIP BPE) comes from open_clip: "
                    "pip install 'omni-rewards[open-clip]', or pass tokenizer="
                ) from e
        self.tokenizer = tokenizer or _ByteTokenizer(self.cfg.context_length, self.cfg.vocab_size)
        n_fft = int(0.025 * self.cfg.audio_sample_rate)
        self.n_fft = n_fft
        self.hop = int(0.010 * self.cfg.audio_sample_rate)
        self.fbank = _mel_filterbank(512, self.cfg.audio_sample_rate, self.cfg.mel_bins)
        self.lock = threading.Lock()

    def embed_text(self, texts: list[str]) -> np.ndarray:
        torch = self.torch
        tok = self.tokenizer(texts)
        tok = torch.as_tensor(np.asarray(tok), dtype=torch.long, device=self.device)
        eos = (
            tok.argmax(dim=-1)
            if not isinstance(self.tokenizer, _ByteTokenizer)
            else (tok == 2).int().argmax(dim=-1)
        )
        with self.lock, torch.no_grad():
            return self.model.encode_text(tok, eos).float().cpu().numpy()

    def _clips(self, video: np.ndarray) -> np.ndarray:
        """(n_clips, 3, clip_frames, S, S) evenly spaced clips, CLIP-normalised."""
        f = self.cfg.clip_frames
        t = len(video)
        starts = np.linspace(0, max(t - f, 0), self.clips_per_video).round().astype(int)
        clips = []
        for s in starts:
            idx = [min(s + k, t - 1) for k in range(f)]
            frames = clip_preprocess(
                [video[i] for i in idx], self.cfg.image_size, OPENAI_MEAN, OPENAI_STD
            )
            clips.append(frames.transpose(1, 0, 2, 3))  # (3, f, S, S)
        return np.stack(clips)

    def embed_video(self, videos: list[np.ndarray]) -> np.ndarray:
        torch = self.torch
        out = []
        with self.lock, torch.no_grad():
            for v in videos:
                x = torch.from_numpy(self._clips(v)).to(self.device)
                e = self.model.encode_vision(x).mean(dim=0)
                out.append(torch.nn.functional.normalize(e, dim=-1).cpu().numpy())
        return np.stack(out).astype(np.float32)

    def _mels(self, wave: np.ndarray) -> np.ndarray:
        """(n_clips, 1, mel_bins, audio_frames) normalised log-mel clips."""
        cfg = self.cfg
        clip_len = int(cfg.audio_clip_seconds * cfg.audio_sample_rate)
        if len(wave) < clip_len:
            wave = np.pad(wave, (0, clip_len - len(wave)))
        starts = np.linspace(0, len(wave) - clip_len, 3).round().astype(int)
        window = np.hanning(self.n_fft + 1)[:-1].astype(np.float32)
        clips = []
        for s in starts:
            x = wave[s : s + clip_len] - wave[s : s + clip_len].mean()
            n_frames = 1 + (len(x) - self.n_fft) // self.hop
            frames = np.stack(
                [x[i * self.hop : i * self.hop + self.n_fft] * window for i in range(n_frames)]
            )
            power = np.abs(np.fft.rfft(frames, n=512)) ** 2
            mel = np.log(np.maximum(power @ self.fbank.T, 1.1920929e-07)).T  # (mel, frames)
            if mel.shape[1] < cfg.audio_frames:
                mel = np.pad(mel, ((0, 0), (0, cfg.audio_frames - mel.shape[1])))
            mel = mel[:, : cfg.audio_frames]
            clips.append(((mel - -4.268) / (9.138 * 2))[None])
        return np.stack(clips).astype(np.float32)

    def embed_audio(self, waves: list[np.ndarray], sample_rate: int) -> np.ndarray:
        torch = self.torch
        out = []
        with self.lock, torch.no_grad():
            for w in waves:
                w = resample(w, sample_rate, self.cfg.audio_sample_rate)
                e = self.model.encode_audio(torch.from_numpy(self._mels(w)).to(self.device)).mean(
                    dim=0
                )
                out.append(torch.nn.functional.normalize(e, dim=-1).cpu().numpy())
        return np.stack(out).astype(np.float32)


def save_imagebind(model: Any, path: str | Path) -> Path:
    """``path/config.json`` + ``path/model.safetensors``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors")
    )
    (path / "config.json").write_text(
        json.dumps({"type": "omni_rewards.imagebind", **asdict(model.config)}, indent=2)
    )
    return path


#: the released checkpoint's towers this reward does not use (they are dropped by name
#: when converting ``imagebind_huge.pth``)
UNUSED_MODALITIES = ("depth", "thermal", "imu")


def load_imagebind(
    path: str | Path, *, config: ImageBindConfig | None = None, device: str = "cpu"
) -> Any:
    """An `ImageBindModel` from a directory with ``config.json`` + ``model.safetensors`` (as
    :func:`save_imagebind` or ``omni-rewards convert imagebind`` write it). Strict: a
    missing, unexpected or mis-shaped tensor is a ``ValueError`` naming it. A released
    ``.pth`` is not read here (no unpickling at load time): convert it once with
    ``omni-rewards convert imagebind imagebind_huge.pth DIR``."""
    torch = require_module("torch", "imagebind", "imagebind")
    path = Path(path).expanduser()
    if path.is_file() and path.suffix in (".pth", ".pt", ".bin", ".ckpt"):
        raise ValueError(
            f"checkpoint: {path} is a torch pickle; convert it once to safetensors with "
            f"`omni-rewards convert imagebind {path} DIR` and pass DIR"
        )
    cfg_file = path / "config.json"
    if not path.is_dir() or not cfg_file.is_file():
        raise FileNotFoundError(f"checkpoint: {path} is not a directory with config.json")
    cfg = config or ImageBindConfig.from_dict(json.loads(cfg_file.read_text()))
    sd = load_state_dict(path / "model.safetensors")
    model = build_imagebind(cfg)
    check_state(model, sd, str(path / "model.safetensors"))
    with torch.no_grad():
        model.load_state_dict(sd, strict=True)
    return model.eval().to(device)


def check_state(model: Any, state: dict[str, Any], source: str) -> None:
    """``ValueError`` listing the missing, unexpected and mis-shaped tensors of ``state``
    against ``model`` (nothing is skipped silently)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(
        f"{k} {tuple(state[k].shape)} != {tuple(own[k].shape)}"
        for k in set(own) & set(state)
        if tuple(state[k].shape) != tuple(own[k].shape)
    )
    if missing or unexpected or shapes:
        parts = [
            f"{len(v)} {label}: {', '.join(v[:8])}"
            for label, v in (("missing", missing), ("unexpected", unexpected), ("shape", shapes))
            if v
        ]
        raise ValueError(
            f"checkpoint {source}: does not match the ImageBind architecture; " + "; ".join(parts)
        )


class ImageBindReward(Reward):
    """Options: ``checkpoint`` (released ``.pth`` or a saved directory) or ``encoder`` (any
    `ImageBindEncoder`), ``mode`` (audio_video | text_audio | text_video | all), ``device``.
    Inputs: ``videos`` (or ``images``, as 1-frame videos) for the video modes, ``audio`` +
    ``sample_rate`` for the audio modes, ``prompts`` for the text modes."""

    name = "imagebind"
    default_batch_size = 8

    def __init__(
        self,
        checkpoint: str | None = None,
        *,
        encoder: ImageBindEncoder | None = None,
        mode: str = "all",
        device: str = "cpu",
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, workers=workers)
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if encoder is None:
            if checkpoint is None:
                raise ValueError("checkpoint: imagebind needs a checkpoint path or an encoder=")
            encoder = TorchImageBindEncoder(
                load_imagebind(checkpoint, device=device), device=device
            )
        self.encoder = encoder
        self.mode = mode

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        need_video = self.mode in ("audio_video", "text_video", "all")
        need_audio = self.mode in ("audio_video", "text_audio", "all")
        need_text = self.mode in ("text_audio", "text_video", "all")
        what = f"imagebind (mode={self.mode})"
        v = a = t = None
        if need_video:
            if inp.videos is None and inp.images is None:
                raise RewardInputError(f"videos: {what} needs `videos` (or `images`)")
            v = self.encoder.embed_video(inp.visual_list(what))
        if need_audio:
            a = self.encoder.embed_audio(inp.audio_list(what), int(inp.sample_rate))  # type: ignore[arg-type]
        if need_text:
            t = self.encoder.embed_text(inp.prompt_list(what))
        details: dict[str, np.ndarray] = {}
        if a is not None and v is not None:
            details["audio_video"] = (a * v).sum(-1)
        if t is not None and a is not None:
            details["text_audio"] = (t * a).sum(-1)
        if t is not None and v is not None:
            details["text_video"] = (t * v).sum(-1)
        if self.mode == "all":
            score = (
                0.5 * details["audio_video"]
                + 0.25 * details["text_audio"]
                + 0.25 * details["text_video"]
            )
        else:
            score = details[self.mode]
        return RewardOutput(
            score.astype(np.float32), {k: x.astype(np.float32) for k, x in details.items()}
        )
