"""``latent``: a latent reward model (LRM) that scores clean diffusion latents without a VAE decode.

In the spirit of DiNa-LRM / latent reward models (e.g. Ding et al. 2025, "Diffusion-native
latent reward modeling"; Mi et al. 2024 "LPO"): a small trainable scorer ``s_theta(z, e)`` on the
clean latent ``z`` (B, C, H, W) or (B, C, F, H, W) and a prompt feature ``e``:

    h   = SiLU(Conv3x3(SiLU(Conv3x3(z))))          (frames folded into the batch for video)
    g   = [mean_hw(h), std_hw(h)]                  (then mean over frames)
    g'  = g * (1 + W_s e) + W_b e                  (FiLM by the prompt feature e)
    out = MLP(g')                                  (a scalar)
    score = out * target_std + target_mean         (teacher units)

``e`` is a hashed bag-of-words of the prompt (``prompt_features="hash"``, no text encoder
needed), per-sample ``metadata[i]["prompt_embeds"]`` (``"metadata"``), or nothing (``"none"``).

`distill_latent` fits the scorer to any image reward (the teacher) on (latent, decoded image)
pairs by minimising  MSE(s, t_norm) + lambda * pairwise logistic ranking loss, and reports the
Spearman rank correlation and pairwise ranking accuracy against the teacher on held-out pairs.
``omni-rewards distill-latent`` is its command line. Weights: safetensors + config.json.
"""

from __future__ import annotations

import itertools
import json
import re
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .base import Reward, require_module
from .types import RewardInput, RewardInputError, RewardOutput, as_numpy

__all__ = [
    "LatentReward",
    "LatentScorerConfig",
    "build_scorer",
    "distill_latent",
    "hash_prompt_features",
    "load_scorer",
    "pairwise_accuracy",
    "save_scorer",
    "spearman",
]


def hash_prompt_features(prompts: list[str], dim: int) -> np.ndarray:
    """Feature hashing of lowercased word unigrams and bigrams into ``dim`` signed buckets, L2-normalised."""
    out = np.zeros((len(prompts), dim), dtype=np.float32)
    for i, p in enumerate(prompts):
        words = re.findall(r"[a-z0-9]+", p.lower())
        grams = words + [f"{a}_{b}" for a, b in itertools.pairwise(words)]
        for g in grams:
            h = zlib.crc32(g.encode())
            out[i, h % dim] += 1.0 if (h >> 16) & 1 else -1.0
        n = np.linalg.norm(out[i])
        if n > 0:
            out[i] /= n
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties)."""

    def ranks(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):
            m = x == v
            if m.sum() > 1:
                r[m] = r[m].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = np.sqrt((ra**2).sum() * (rb**2).sum())
    return float((ra * rb).sum() / den) if den > 0 else 0.0


def pairwise_accuracy(pred: np.ndarray, target: np.ndarray) -> float:
    """Fraction of pairs (i < j, target_i != target_j) ordered the same way by pred and target."""
    pred, target = np.asarray(pred, np.float64), np.asarray(target, np.float64)
    dp = np.sign(pred[:, None] - pred[None, :])
    dt = np.sign(target[:, None] - target[None, :])
    mask = np.triu(dt != 0, 1)
    return float((dp[mask] == dt[mask]).mean()) if mask.any() else 1.0


@dataclass
class LatentScorerConfig:
    in_channels: int
    hidden: int = 64
    prompt_dim: int = 64
    prompt_features: str = "hash"  # "hash" | "metadata" | "none"
    target_mean: float = 0.0
    target_std: float = 1.0
    teacher: str = ""

    def __post_init__(self) -> None:
        if self.prompt_features not in ("hash", "metadata", "none"):
            raise ValueError(
                f"prompt_features: expected hash|metadata|none, got {self.prompt_features!r}"
            )
        if self.prompt_features == "none":
            self.prompt_dim = 0


def build_scorer(cfg: LatentScorerConfig) -> Any:
    """The scorer ``torch.nn.Module`` for ``cfg`` (see the module docstring)."""
    torch = require_module("torch", "latent", "latent")
    nn = torch.nn

    class LatentScorer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h = cfg.hidden
            self.conv1 = nn.Conv2d(cfg.in_channels, h, 3, padding=1)
            self.conv2 = nn.Conv2d(h, h, 3, padding=1, stride=2)
            # FiLM: the prompt feature scales and shifts the pooled latent features
            self.film = nn.Linear(cfg.prompt_dim, 4 * h) if cfg.prompt_dim else None
            self.head = nn.Sequential(nn.Linear(2 * h, h), nn.SiLU(), nn.Linear(h, 1))

        def forward(self, z: Any, e: Any = None) -> Any:
            frames = 1
            if z.ndim == 5:  # (B, C, F, H, W) -> (B*F, C, H, W)
                b, c, frames, hh, ww = z.shape
                z = z.permute(0, 2, 1, 3, 4).reshape(b * frames, c, hh, ww)
            x = nn.functional.silu(self.conv2(nn.functional.silu(self.conv1(z))))
            g = torch.cat([x.mean(dim=(2, 3)), x.flatten(2).std(dim=2, unbiased=False)], dim=1)
            g = g.reshape(-1, frames, g.shape[1]).mean(dim=1)
            if self.film is not None:
                if e is None:
                    raise RewardInputError(
                        "prompts: this latent scorer was trained with prompt features"
                    )
                scale, shift = self.film(e).chunk(2, dim=1)
                g = g * (1 + scale) + shift
            return self.head(g).squeeze(-1)

    return LatentScorer()


def save_scorer(
    model: Any, cfg: LatentScorerConfig, path: str | Path, report: dict[str, Any] | None = None
) -> Path:
    """``path/model.safetensors`` + ``path/config.json`` (+ ``path/report.json``)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
        str(path / "model.safetensors"),
    )
    (path / "config.json").write_text(
        json.dumps({"type": "omni_rewards.latent", **asdict(cfg)}, indent=2)
    )
    if report is not None:
        (path / "report.json").write_text(json.dumps(report, indent=2))
    return path


def load_scorer(path: str | Path, device: str = "cpu") -> tuple[Any, LatentScorerConfig]:
    require_module("safetensors", "latent", "latent")
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"path: {path} has no config.json (save it with save_scorer / distill-latent)"
        )
    raw = json.loads((path / "config.json").read_text())
    raw.pop("type", None)
    cfg = LatentScorerConfig(**raw)
    model = build_scorer(cfg)
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model.eval().to(device), cfg


def _prompt_features(cfg: LatentScorerConfig, inp: RewardInput, n: int) -> np.ndarray | None:
    if cfg.prompt_features == "none":
        return None
    if cfg.prompt_features == "hash":
        if inp.prompts is None:
            raise RewardInputError(
                "prompts: this latent scorer uses prompt features; pass `prompts`"
            )
        return hash_prompt_features(inp.prompt_list("latent"), cfg.prompt_dim)
    rows = []
    for i in range(n):
        e = inp.metadata_for(i).get("prompt_embeds")
        if e is None:
            raise RewardInputError(
                f"metadata[{i}]: missing 'prompt_embeds' (the scorer uses prompt embeddings)"
            )
        e = as_numpy(e).astype(np.float32).reshape(-1)
        if e.shape[0] != cfg.prompt_dim:
            raise RewardInputError(
                f"metadata[{i}]['prompt_embeds']: expected {cfg.prompt_dim} values, got {e.shape[0]}"
            )
        rows.append(e)
    return np.stack(rows)


class LatentReward(Reward):
    """``latent``: score = s_theta(latent, prompt feature) in teacher units, no decode.

    Options: ``path`` (a directory written by `save_scorer` / ``distill-latent``), ``device``.
    Inputs: ``latents`` (B, C, H, W) or (B, C, F, H, W), plus ``prompts`` when the scorer uses
    hashed prompt features, or ``metadata[i]["prompt_embeds"]``.
    """

    name = "latent"
    default_batch_size = 64

    def __init__(
        self,
        path: str | None = None,
        *,
        device: str = "cpu",
        batch_size: int | None = None,
        workers: int = 1,
    ):
        super().__init__(batch_size=batch_size, workers=workers)
        if path is None:
            raise ValueError(
                "path: latent needs the directory of a trained scorer (omni-rewards distill-latent)"
            )
        self.torch = require_module("torch", "latent", "latent")
        self.device = device
        self.model, self.cfg = load_scorer(path, device)

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        lat = inp.require("latents", self.name)
        z = np.stack([as_numpy(x) for x in lat]) if isinstance(lat, list | tuple) else as_numpy(lat)
        z = z.astype(np.float32, copy=False)
        if z.ndim not in (4, 5) or z.shape[1] != self.cfg.in_channels:
            raise RewardInputError(
                f"latents: expected (B, {self.cfg.in_channels}, H, W) or (B, {self.cfg.in_channels}, F, H, W), got {z.shape}"
            )
        e = _prompt_features(self.cfg, inp, z.shape[0])
        torch = self.torch
        with torch.no_grad():
            zt = torch.as_tensor(np.ascontiguousarray(z), dtype=torch.float32, device=self.device)
            et = None if e is None else torch.as_tensor(e, device=self.device)
            s = self.model(zt, et).float().cpu().numpy()
        return RewardOutput(s * self.cfg.target_std + self.cfg.target_mean)


def distill_latent(
    teacher: Reward,
    latents: np.ndarray,
    images: np.ndarray | list[np.ndarray],
    *,
    prompts: list[str] | None = None,
    prompt_embeds: np.ndarray | None = None,
    hidden: int = 64,
    prompt_dim: int = 64,
    steps: int = 300,
    lr: float = 3e-3,
    batch_size: int | None = None,
    rank_weight: float = 1.0,
    holdout: float = 0.2,
    seed: int = 0,
    teacher_name: str = "",
    progress: bool = False,
) -> tuple[Any, LatentScorerConfig, dict[str, Any]]:
    """Fit a latent scorer to ``teacher`` on (latent, decoded image) pairs.

    Each of the ``steps`` Adam steps fits all training pairs, or with ``batch_size`` a random
    minibatch of that many (the ranking loss within it): the cost of a step then no longer
    grows with the number of pairs.

    Returns ``(model, config, report)``; ``report`` has ``spearman`` and
    ``pairwise_accuracy`` against the teacher on the held-out pairs, ``train_spearman``,
    the counts and the timings. ``progress``: a tqdm bar over the steps (the loss every 10).
    """
    torch = require_module("torch", "latent", "distill-latent")
    z = np.asarray(latents, dtype=np.float32)
    n = z.shape[0]
    if n < 10:
        raise ValueError(f"latents: need at least 10 pairs to distil, got {n}")
    if batch_size is not None and batch_size < 2:
        raise ValueError(f"batch_size: need at least 2 pairs a step, got {batch_size}")
    t0 = time.perf_counter()
    inp = RewardInput(images=images, prompts=prompts)
    targets = teacher(inp).scores.astype(np.float64)
    t_teacher = time.perf_counter() - t0
    if prompt_embeds is not None:
        e = np.asarray(prompt_embeds, np.float32).reshape(n, -1)
        mode, prompt_dim = "metadata", e.shape[1]
    elif prompts is not None:
        mode = "hash"
        e = hash_prompt_features(list(prompts), prompt_dim)
    else:
        mode, e = "none", None
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    n_test = max(2, round(holdout * n))
    test, train = perm[:n_test], perm[n_test:]
    mean, std = float(targets[train].mean()), float(targets[train].std() + 1e-8)
    cfg = LatentScorerConfig(
        in_channels=int(z.shape[1]),
        hidden=hidden,
        prompt_dim=prompt_dim if mode != "none" else 0,
        prompt_features=mode,
        target_mean=mean,
        target_std=std,
        teacher=teacher_name,
    )
    torch.manual_seed(seed)
    model = build_scorer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    zt = torch.from_numpy(z)
    et = None if e is None else torch.from_numpy(e)
    yt = torch.from_numpy(((targets - mean) / std).astype(np.float32))
    tr = torch.from_numpy(train)
    draws = torch.Generator().manual_seed(seed)
    t1 = time.perf_counter()
    model.train()
    tqdm = require_module("tqdm.auto", "latent", "distill-latent").tqdm
    bar = tqdm(range(int(steps)), desc="latent scorer", unit="step", disable=not progress)
    for i in bar:
        rows = tr
        if batch_size is not None and batch_size < len(tr):
            rows = tr[torch.randperm(len(tr), generator=draws)[:batch_size]]
        pred = model(zt[rows], None if et is None else et[rows])
        y = yt[rows]
        loss = torch.nn.functional.mse_loss(pred, y)
        if rank_weight:
            dp = pred[:, None] - pred[None, :]
            dy = torch.sign(y[:, None] - y[None, :])
            mask = dy != 0
            if mask.any():
                loss = (
                    loss + rank_weight * torch.nn.functional.softplus(-dy[mask] * dp[mask]).mean()
                )
        opt.zero_grad()
        loss.backward()
        opt.step()
        if progress and i % 10 == 0:  # .item() only for a bar someone sees
            bar.set_postfix(loss=f"{loss.item():.4f}")
    bar.close()
    model.eval()
    with torch.no_grad():
        pred_all = model(zt, et).numpy() * std + mean
    report = {
        "teacher": teacher_name,
        "pairs": int(n),
        "train_pairs": len(train),
        "heldout_pairs": len(test),
        "spearman": spearman(pred_all[test], targets[test]),
        "pairwise_accuracy": pairwise_accuracy(pred_all[test], targets[test]),
        "train_spearman": spearman(pred_all[train], targets[train]),
        "final_loss": float(loss.item()),
        "teacher_seconds": t_teacher,
        "train_seconds": time.perf_counter() - t1,
    }
    return model, cfg, report


def synthetic_pairs(
    n: int, seed: int = 0, channels: int = 4, size: int = 8, scale: int = 4
) -> dict[str, Any]:
    """Random latents and a fixed random linear "decoder" (1x1 conv to RGB, nearest upsampling,
    tanh); prompts name colours. For demos and tests without a VAE."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, channels, size, size)).astype(np.float32)
    z += rng.standard_normal((n, channels, 1, 1)).astype(np.float32)  # per-sample global shifts
    w = rng.standard_normal((3, channels)).astype(np.float32) / np.sqrt(channels)
    rgb = np.einsum("oc,nchw->nhwo", w, z)
    rgb = np.repeat(np.repeat(rgb, scale, axis=1), scale, axis=2)
    images = np.clip((np.tanh(rgb) + 1) * 127.5, 0, 255).astype(np.uint8)
    colours = ["red", "green", "blue", "yellow", "cyan", "magenta", "white", "black"]
    prompts = [f"a {colours[i % len(colours)]} picture" for i in range(n)]
    return {"latents": z, "images": images, "prompts": prompts}


def distill_main(args: Any) -> int:
    """``omni-rewards distill-latent`` (argparse namespace from `omni_rewards.cli`)."""
    from .options import parse_options
    from .registry import load_reward

    if args.synthetic:
        data = synthetic_pairs(args.synthetic, seed=args.seed)
    elif args.data:
        from safetensors.numpy import load_file

        t = load_file(args.data)
        for key in ("latents", "images"):
            if key not in t:
                raise SystemExit(f"--data {args.data}: missing tensor {key!r} (has {sorted(t)})")
        data = {
            "latents": t["latents"],
            "images": t["images"],
            "prompt_embeds": t.get("prompt_embeds"),
        }
        if args.prompts:
            data["prompts"] = json.loads(Path(args.prompts).read_text())
    else:
        raise SystemExit("distill-latent: pass --data FILE.safetensors or --synthetic N")
    teacher = load_reward(args.teacher, **parse_options(args.teacher_option))
    model, cfg, report = distill_latent(
        teacher,
        data["latents"],
        data["images"],
        prompts=data.get("prompts"),
        prompt_embeds=data.get("prompt_embeds"),
        hidden=args.hidden,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        holdout=args.holdout,
        seed=args.seed,
        teacher_name=args.teacher,
        progress=not args.no_progress,
    )
    save_scorer(model, cfg, args.out, report)
    print(
        f"distilled {args.teacher} on {report['train_pairs']} pairs; held-out ({report['heldout_pairs']}): "
        f"spearman={report['spearman']:.3f} pairwise_accuracy={report['pairwise_accuracy']:.3f}; saved to {args.out}"
    )
    return 0
