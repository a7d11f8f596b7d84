"""CLIP-family rewards: ``clip_score``, ``pickscore``, ``hpsv2``, ``aesthetic``.

With unit image embedding u = f_img(x) / ||f_img(x)|| and text embedding v = f_txt(p) / ||.||:

- ``clip_score`` (Radford et al. 2021; Hessel et al. 2021): score = exp(logit_scale) * u . v
  (CLIP's own temperature, 100 for OpenAI CLIP). ``backend="transformers"`` (CLIPModel, extra
  ``clip``) or ``backend="open_clip"`` (extra ``open-clip``).
- ``pickscore`` (Kirstain et al. 2023, "Pick-a-Pic"): the PickScore CLIP-H model,
  score = exp(logit_scale) * u . v / 26, so typical scores lie near [0, 1] (as in Flow-GRPO).
- ``hpsv2`` (Wu et al. 2023, "Human Preference Score v2"): open_clip ViT-H-14 with the HPS v2.1
  checkpoint, score = u . v (the raw cosine).
- ``aesthetic`` (LAION aesthetic predictor v2, Schuhmann et al. 2022): an MLP head on the
  unit CLIP ViT-L/14 image embedding, score = MLP(u); the head comes from a safetensors file
  with keys ``layers.<i>.weight`` / ``layers.<i>.bias`` (Linear layers in index order, no
  activations between them, as in the released predictor).

Inputs: ``images`` (or ``videos``: mean over ``video_frames`` evenly spaced frames), and
``prompts`` (not for ``aesthetic``). Nothing downloads unless ``model`` is a hub id and the
user allows it; tests use tiny random models saved to disk.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from .base import Reward, require_module
from .types import RewardInput, RewardInputError, RewardOutput

__all__ = [
    "AestheticReward",
    "CLIPScoreReward",
    "HFCLIPEncoder",
    "HPSv2Reward",
    "OpenCLIPEncoder",
    "PickScoreReward",
    "clip_preprocess",
    "load_state_dict",
]

#: the processor the PickScore release is used with (its repo holds no tokenizer)
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def _torch(reward: str, extra: str = "clip") -> Any:
    return require_module("torch", extra, reward)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    torch = _torch("clip")
    return "cuda" if torch.cuda.is_available() else "cpu"


def clip_preprocess(
    images: list[np.ndarray],
    size: int,
    mean: tuple[float, ...] = OPENAI_MEAN,
    std: tuple[float, ...] = OPENAI_STD,
) -> np.ndarray:
    """CLIP preprocessing: resize the short side to ``size`` (bicubic), centre-crop, normalise.

    Returns float32 (B, 3, size, size).
    """
    out = np.empty((len(images), 3, size, size), dtype=np.float32)
    m = np.asarray(mean, np.float32)[:, None, None]
    s = np.asarray(std, np.float32)[:, None, None]
    for i, im in enumerate(images):
        pil = Image.fromarray(im)
        w, h = pil.size
        scale = size / min(w, h)
        nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
        pil = pil.resize((nw, nh), Image.BICUBIC)
        left, top = (nw - size) // 2, (nh - size) // 2
        pil = pil.crop((left, top, left + size, top + size))
        out[i] = (np.asarray(pil, np.float32).transpose(2, 0, 1) / 255.0 - m) / s
    return out


def load_state_dict(path: str | Path) -> dict[str, Any]:
    """Tensors of a ``.safetensors`` file. Torch pickles (``.pt``/``.pth``/``.bin``) are not
    read at load time: ``omni-rewards convert`` turns a released one into safetensors once."""
    _torch("load_state_dict")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint: no such file {path}")
    if path.suffix != ".safetensors":
        raise ValueError(
            f"checkpoint: {path} is not a .safetensors file; convert a released torch "
            f"checkpoint once with `omni-rewards convert KIND {path} OUT.safetensors` "
            "(KIND: hpsv2, aesthetic, state-dict)"
        )
    from safetensors.torch import load_file

    return load_file(str(path))


def _has_tokenizer(model: str) -> bool:
    """A hub id is assumed to carry its tokenizer; a local folder must have the files."""
    p = Path(model).expanduser()
    return not p.is_dir() or any((p / f).is_file() for f in _TOKENIZER_FILES)


def load_hf_model(klass: Any, model: str, reward: str, **kwargs: Any) -> Any:
    """``klass.from_pretrained(model)`` from safetensors only (a folder with only
    ``pytorch_model.bin`` is an error, never a ``torch.load``), strict: a missing or
    unexpected tensor is a ``ValueError`` naming it (transformers would initialise it at
    random and only warn)."""
    try:
        obj, info = klass.from_pretrained(
            model, use_safetensors=True, output_loading_info=True, **kwargs
        )
    except OSError as exc:
        raise ValueError(
            f"model: {reward} could not load {model!r} from safetensors ({exc}); a folder "
            "with only pytorch_model.bin: `omni-rewards convert state-dict` it to "
            "model.safetensors"
        ) from None
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(str(m) for m in info.get("mismatched_keys") or ())
    if missing or unexpected or mismatched:
        raise ValueError(
            f"model: {model} does not match {klass.__name__}: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}, shape mismatch {mismatched[:8]}"
        )
    return obj


def _features(out: Any) -> Any:
    """transformers 5 returns a model output with ``pooler_output``; older versions a tensor."""
    return out if hasattr(out, "norm") else out.pooler_output


class HFCLIPEncoder:
    """A transformers `CLIPModel` (local path or hub id) with its tokenizer."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
    ):
        torch = _torch("clip")
        transformers = require_module("transformers", "clip", "clip")
        self.torch = torch
        self.device = resolve_device(device)
        self.model = (
            load_hf_model(transformers.CLIPModel, model, "clip", dtype=getattr(torch, dtype))
            .eval()
            .to(self.device)
        )
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer or model)
        except OSError as exc:
            raise ValueError(f"tokenizer: cannot load {tokenizer or model!r} ({exc})") from None
        self.size = int(self.model.config.vision_config.image_size)
        self.max_length = int(self.model.config.text_config.max_position_embeddings)
        self.mean, self.std = OPENAI_MEAN, OPENAI_STD
        pp = Path(model) / "preprocessor_config.json"
        if pp.is_file():
            cfg = json.loads(pp.read_text())
            self.mean = tuple(cfg.get("image_mean", self.mean))
            self.std = tuple(cfg.get("image_std", self.std))
        self.dtype = getattr(torch, dtype)
        self.lock = threading.Lock()

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.exp().item())

    def encode_images(self, images: list[np.ndarray]) -> Any:
        x = self.torch.from_numpy(clip_preprocess(images, self.size, self.mean, self.std))
        with self.lock, self.torch.no_grad():
            f = _features(self.model.get_image_features(pixel_values=x.to(self.device, self.dtype)))
        return self.torch.nn.functional.normalize(f.float(), dim=-1)

    def encode_texts(self, texts: list[str]) -> Any:
        tok = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        with self.lock, self.torch.no_grad():
            f = _features(
                self.model.get_text_features(
                    input_ids=tok["input_ids"].to(self.device),
                    attention_mask=tok["attention_mask"].to(self.device),
                )
            )
        return self.torch.nn.functional.normalize(f.float(), dim=-1)


class OpenCLIPEncoder:
    """An open_clip model: an architecture name (or a config dict) plus an optional checkpoint."""

    def __init__(
        self,
        architecture: str = "ViT-H-14",
        *,
        checkpoint: str | None = None,
        model_config: dict[str, Any] | None = None,
        device: str = "cpu",
    ) -> None:
        torch = _torch("open_clip", "open-clip")
        open_clip = require_module("open_clip", "open-clip", "open_clip")
        self.torch = torch
        self.device = resolve_device(device)
        if model_config is not None:
            model = open_clip.CLIP(**model_config)
            name = None
        else:
            model = open_clip.create_model(architecture, pretrained=None)
            name = architecture
        if checkpoint is not None:
            sd = load_state_dict(checkpoint)
            missing, unexpected = model.load_state_dict(sd, strict=False)
            # open_clip's causal attn_mask is a non-persistent buffer in recent releases
            missing = [k for k in missing if not k.endswith("attn_mask")]
            if missing or unexpected:
                raise ValueError(
                    f"checkpoint {checkpoint}: does not match the architecture "
                    f"({len(missing)} missing {missing[:8]}, {len(unexpected)} unexpected "
                    f"{unexpected[:8]})"
                )
        self.model = model.eval().to(self.device)
        vis = model.visual
        size = getattr(vis, "image_size", 224)
        self.size = int(size[0] if isinstance(size, tuple | list) else size)
        self.context_length = int(getattr(model, "context_length", 77))
        self.tokenizer = (
            open_clip.get_tokenizer(name)
            if name
            else open_clip.SimpleTokenizer(context_length=self.context_length)
        )
        self.lock = threading.Lock()

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.exp().item())

    def encode_images(self, images: list[np.ndarray]) -> Any:
        x = self.torch.from_numpy(clip_preprocess(images, self.size)).to(self.device)
        with self.lock, self.torch.no_grad():
            f = self.model.encode_image(x)
        return self.torch.nn.functional.normalize(f.float(), dim=-1)

    def encode_texts(self, texts: list[str]) -> Any:
        tok = self.tokenizer(texts).to(self.device)
        with self.lock, self.torch.no_grad():
            f = self.model.encode_text(tok)
        return self.torch.nn.functional.normalize(f.float(), dim=-1)


def _frames(inp: RewardInput, reward: str, video_frames: int) -> tuple[list[np.ndarray], list[int]]:
    """Flattened frames and, per sample, how many frames it has."""
    frames, counts = [], []
    for v in inp.visual_list(reward):
        idx = np.unique(np.linspace(0, len(v) - 1, min(video_frames, len(v))).round()).astype(int)
        frames.extend(v[i] for i in idx)
        counts.append(len(idx))
    return frames, counts


def _per_sample_mean(values: np.ndarray, counts: list[int]) -> np.ndarray:
    out, start = [], 0
    for c in counts:
        out.append(values[start : start + c].mean())
        start += c
    return np.array(out, dtype=np.float32)


class _CosineReward(Reward):
    default_batch_size = 32

    def __init__(
        self,
        encoder: Any,
        *,
        scale: float | None,
        divide: float = 1.0,
        video_frames: int = 4,
        **kw: Any,
    ):
        super().__init__(**kw)
        self.encoder = encoder
        self.scale = scale
        self.divide = float(divide)
        self.video_frames = int(video_frames)

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        prompts = inp.prompt_list(self.name)
        frames, counts = _frames(inp, self.name, self.video_frames)
        img = self.encoder.encode_images(frames)
        txt = self.encoder.encode_texts(prompts)
        rows = np.repeat(np.arange(len(counts)), counts)
        cos = (img * txt[rows]).sum(-1).cpu().numpy()
        cos = _per_sample_mean(cos, counts)
        scale = self.encoder.logit_scale if self.scale is None else self.scale
        return RewardOutput(scale * cos / self.divide, {"cosine": cos})


class CLIPScoreReward(_CosineReward):
    """``clip_score``: exp(logit_scale) * cos(image, prompt).

    Options: ``model`` (transformers path/hub id, or open_clip architecture name),
    ``backend`` ("transformers" | "open_clip"), ``checkpoint`` and ``model_config`` (open_clip),
    ``tokenizer``, ``scale`` (override exp(logit_scale)), ``device``, ``batch_size``.
    """

    name = "clip_score"

    def __init__(
        self,
        model: str = "openai/clip-vit-large-patch14",
        *,
        backend: str = "transformers",
        tokenizer: str | None = None,
        checkpoint: str | None = None,
        model_config: dict[str, Any] | None = None,
        scale: float | None = None,
        device: str = "cpu",
        video_frames: int = 4,
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        if backend == "transformers":
            enc: Any = HFCLIPEncoder(model, tokenizer=tokenizer, device=device)
        elif backend == "open_clip":
            enc = OpenCLIPEncoder(
                model, checkpoint=checkpoint, model_config=model_config, device=device
            )
        else:
            raise ValueError(f"backend: expected 'transformers' or 'open_clip', got {backend!r}")
        super().__init__(
            enc, scale=scale, video_frames=video_frames, batch_size=batch_size, workers=workers
        )


class PickScoreReward(_CosineReward):
    """``pickscore``: exp(logit_scale) * cos(image, prompt) / 26 with the PickScore CLIP.

    Options: ``model`` (default ``yuvalkirstain/PickScore_v1``: a transformers ``CLIPModel``
    folder, ``config.json`` + ``model.safetensors``), ``tokenizer`` (default: the model
    folder's own tokenizer files if it has them, else the released model's processor
    ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, as the PickScore README loads it).
    """

    name = "pickscore"

    def __init__(
        self,
        model: str = "yuvalkirstain/PickScore_v1",
        *,
        tokenizer: str | None = None,
        device: str = "cpu",
        video_frames: int = 4,
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        if tokenizer is None and not _has_tokenizer(model):
            tokenizer = PICKSCORE_PROCESSOR
        enc = HFCLIPEncoder(model, tokenizer=tokenizer, device=device)
        super().__init__(
            enc,
            scale=None,
            divide=26.0,
            video_frames=video_frames,
            batch_size=batch_size,
            workers=workers,
        )


class HPSv2Reward(_CosineReward):
    """``hpsv2``: cos(image, prompt) with open_clip ViT-H-14 and an HPS v2.1 checkpoint.

    Options: ``checkpoint`` (required: local ``HPS_v2.1_compressed.pt`` or a safetensors
    conversion), ``architecture`` ("ViT-H-14"), ``model_config`` (an open_clip config dict
    instead of the architecture, for tests), ``device``.
    """

    name = "hpsv2"

    def __init__(
        self,
        checkpoint: str | None = None,
        *,
        architecture: str = "ViT-H-14",
        model_config: dict[str, Any] | None = None,
        device: str = "cpu",
        video_frames: int = 4,
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        if checkpoint is None and model_config is None:
            raise ValueError("checkpoint: hpsv2 needs the local path of the HPS v2.1 checkpoint")
        enc = OpenCLIPEncoder(
            architecture, checkpoint=checkpoint, model_config=model_config, device=device
        )
        super().__init__(
            enc, scale=1.0, video_frames=video_frames, batch_size=batch_size, workers=workers
        )


def build_aesthetic_head(state: dict[str, Any]) -> Any:
    """``torch.nn.Sequential`` of the Linear layers ``layers.<i>`` in index order."""
    torch = _torch("aesthetic")
    idx = sorted(
        {int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.endswith(".weight")}
    )
    if not idx:
        raise ValueError(
            f"aesthetic head: expected keys 'layers.<i>.weight', got {sorted(state)[:5]}"
        )
    layers = []
    prev_out = None
    for i in idx:
        w = state[f"layers.{i}.weight"]
        if w.ndim != 2:
            raise ValueError(f"aesthetic head: layers.{i}.weight must be 2-D, got {tuple(w.shape)}")
        if prev_out is not None and w.shape[1] != prev_out:
            raise ValueError(
                f"aesthetic head: layers.{i} takes {w.shape[1]} inputs but the previous layer gives {prev_out}"
            )
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=f"layers.{i}.bias" in state)
        with torch.no_grad():
            lin.weight.copy_(w)
            if lin.bias is not None:
                lin.bias.copy_(state[f"layers.{i}.bias"])
        layers.append(lin)
        prev_out = w.shape[0]
    if prev_out != 1:
        raise ValueError(f"aesthetic head: the last layer must output 1 value, gives {prev_out}")
    return torch.nn.Sequential(*layers).eval()


class AestheticReward(Reward):
    """``aesthetic``: MLP(unit CLIP image embedding), MLP from ``head`` (safetensors).

    Options: ``head`` (required), ``clip_model`` (transformers CLIP path, default
    ``openai/clip-vit-large-patch14``), ``device``.
    """

    name = "aesthetic"
    default_batch_size = 32

    def __init__(
        self,
        head: str | None = None,
        *,
        clip_model: str = "openai/clip-vit-large-patch14",
        device: str = "cpu",
        video_frames: int = 4,
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, workers=workers)
        if head is None:
            raise ValueError("head: aesthetic needs the path of the MLP head (.safetensors)")
        self.encoder = HFCLIPEncoder(clip_model, device=device)
        self.head = build_aesthetic_head(load_state_dict(head)).to(self.encoder.device)
        dim = self.head[0].in_features
        proj = int(self.encoder.model.config.projection_dim)
        if dim != proj:
            raise ValueError(f"head: expects {dim}-d embeddings but the CLIP model gives {proj}-d")
        self.video_frames = int(video_frames)

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        if inp.prompts is None and inp.images is None and inp.videos is None:
            raise RewardInputError("images: aesthetic needs `images` or `videos`")
        frames, counts = _frames(inp, self.name, self.video_frames)
        emb = self.encoder.encode_images(frames)
        with self.encoder.torch.no_grad():
            s = self.head(emb).squeeze(-1).float().cpu().numpy()
        return RewardOutput(_per_sample_mean(s, counts))
