"""Shared test helpers: a tiny deterministic denoiser that satisfies the Denoiser protocol."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from diffusion_rollout import RolloutRequest, SamplingParams


class ToyDenoiser(nn.Module):
    """A small conv velocity model with per-row text conditioning.

    Latents are (B, C, H/8, W/8) for images and (B, C, F, H/8, W/8) for video (frames folded
    into the batch for the convs). Prompts are embedded from their character codes, padded to
    a fixed length. Guidance packs the conditional and negative branches into one forward.
    """

    def __init__(
        self,
        channels: int = 4,
        hidden: int = 16,
        dim: int = 8,
        seq: int = 6,
        seed: int = 0,
        shift: float = 3.0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.channels, self.seq, self.shift = channels, seq, shift
        self.embed = nn.Embedding(256, dim)
        self.proj_in = nn.Conv2d(channels, hidden, 3, padding=1)
        self.cond_proj = nn.Linear(dim, hidden)
        self.time_proj = nn.Linear(1, hidden)
        self.proj_out = nn.Conv2d(hidden, channels, 3, padding=1)
        self.forward_rows: list[int] = []
        self._lock = threading.Lock()

    # --- Denoiser protocol
    def _embed(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        ids = torch.zeros(len(prompts), self.seq, dtype=torch.long)
        for i, p in enumerate(prompts):
            codes = [min(ord(c), 255) for c in p[: self.seq]]
            if codes:
                ids[i, : len(codes)] = torch.tensor(codes)
        emb = self.embed(ids)
        return emb, emb.mean(dim=1)

    def encode(self, prompts, negative_prompts=None, *, params=None):
        emb, pooled = self._embed(list(prompts))
        negs = [""] * len(prompts) if negative_prompts is None else list(negative_prompts)
        nemb, npooled = self._embed(negs)
        return {
            "prompt_embeds": emb,
            "pooled_prompt_embeds": pooled,
            "negative_prompt_embeds": nemb,
            "negative_pooled_prompt_embeds": npooled,
        }

    def latent_shape(self, params) -> tuple[int, ...]:
        h, w = params.height // 8, params.width // 8
        if params.num_frames > 1:
            return (self.channels, params.num_frames, h, w)
        return (self.channels, h, w)

    def init_latents(self, batch, params, generators):
        assert len(generators) == batch
        shape = self.latent_shape(params)
        return torch.stack([torch.randn(shape, generator=g) for g in generators])

    def sigmas(self, params):
        t = torch.linspace(1.0, 0.0, params.num_steps + 1, dtype=torch.float32)
        return self.shift * t / (1 + (self.shift - 1) * t)

    def _forward(self, x: Tensor, sigma: Tensor, pooled: Tensor) -> Tensor:
        with self._lock:
            self.forward_rows.append(x.shape[0])
        video = x.ndim == 5
        if video:
            b, c, f, h, w = x.shape
            x = x.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
            pooled = pooled.repeat_interleave(f, dim=0)
            sigma = sigma.repeat_interleave(f, dim=0)
        hid = self.proj_in(x) + self.cond_proj(pooled)[:, :, None, None]
        hid = hid + self.time_proj(sigma[:, None])[:, :, None, None]
        out = self.proj_out(F.silu(hid))
        if video:
            out = out.reshape(b, f, c, h, w).permute(0, 2, 1, 3, 4)
        return out

    def velocity(self, latents, sigma, condition, params):
        assert sigma.shape == (latents.shape[0],)
        scale = params.true_cfg_scale if params.true_cfg_scale > 1 else params.guidance_scale
        if scale <= 1:
            return self._forward(latents, sigma, condition["pooled_prompt_embeds"])
        both = self._forward(
            torch.cat([latents, latents]),
            torch.cat([sigma, sigma]),
            torch.cat(
                [condition["pooled_prompt_embeds"], condition["negative_pooled_prompt_embeds"]]
            ),
        )
        pos, neg = both.chunk(2)
        return neg + scale * (pos - neg)

    def decode(self, latents):
        x = latents[:, :3]
        if x.ndim == 5:
            x = x.permute(0, 2, 3, 4, 1)  # B F H W 3
        else:
            x = x.permute(0, 2, 3, 1)
        return ((torch.tanh(x) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)

    def load_weights(self, tensors):
        params = dict(self.named_parameters())
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise KeyError(f"unknown weight names {unknown}")
        with torch.no_grad():
            for k, t in tensors.items():
                params[k].copy_(t)


class ToyEditDenoiser(ToyDenoiser):
    """ToyDenoiser conditioned on an image too (``needs_images``, like Qwen-Image-Edit).

    ``encode(..., images=)`` takes uint8 (B, H, W, 3) or a list of (H, W, 3) of any sizes,
    resizes each row alone to 8x8 (bilinear) and adds a projection of it to both branches'
    pooled embedding; the resized image is the shared ``image_latents`` key. A list of per-row
    lists (several condition images, like Qwen-Image-Edit-Plus) adds each image's projection
    weighted by its position (1, 2, ...), and ``image_latents`` is then (B, K, 3, 8, 8).
    """

    needs_images = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.img_proj = nn.Linear(3 * 8 * 8, self.embed.embedding_dim)
        self.seen_images: list = []

    def encode(self, prompts, negative_prompts=None, images=None, *, params=None):
        if images is None:
            raise ValueError("images: the toy edit denoiser needs condition images")
        self.seen_images.append(images)
        rows = list(images) if isinstance(images, (list, tuple)) else list(images.unbind(0))
        assert len(rows) == len(prompts)

        def resize(r):
            x = r.permute(2, 0, 1)[None].float() / 255.0
            return F.interpolate(x, size=(8, 8), mode="bilinear", align_corners=False)

        out = super().encode(prompts, negative_prompts)
        if rows and isinstance(rows[0], list):
            assert len({len(r) for r in rows}) == 1, "rows carry different image counts"
            small = torch.stack([torch.cat([resize(im) for im in r]) for r in rows])
            w = torch.arange(1, small.shape[1] + 1, dtype=small.dtype).view(1, -1, 1)
            feat = (self.img_proj(small.flatten(2)) * w).sum(1)
        else:
            small = torch.cat([resize(r) for r in rows])
            feat = self.img_proj(small.flatten(1))
        out["pooled_prompt_embeds"] = out["pooled_prompt_embeds"] + feat
        out["negative_pooled_prompt_embeds"] = out["negative_pooled_prompt_embeds"] + feat
        out["image_latents"] = small
        return out


@pytest.fixture
def toy() -> ToyDenoiser:
    return ToyDenoiser()


@pytest.fixture
def toy_edit() -> ToyEditDenoiser:
    return ToyEditDenoiser()


def make_requests(
    n: int, params: SamplingParams | None = None, seed0: int = 100, prefix: str = "r"
) -> list[RolloutRequest]:
    params = params or SamplingParams(height=32, width=32, num_steps=6, output="both")
    prompts = ["a cat", "a dog", "red car", "blue sky", "two birds"]
    return [
        RolloutRequest(prompts[i % len(prompts)], seed0 + i, params, f"{prefix}{i}")
        for i in range(n)
    ]


def max_diff(a, b) -> float:
    """Max |a - b| over every tensor of two trajectories (latents, log-probs, final, media)."""
    d = 0.0
    for name in ("latents", "log_probs", "sigmas", "sigmas_next", "final_latent"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
            continue
        assert x.shape == y.shape, name
        d = max(d, (x.double() - y.double()).abs().max().item() if x.numel() else 0.0)
    return d


@pytest.fixture
def toy_cls():
    return ToyDenoiser


@pytest.fixture(name="make_requests")
def _make_requests_fixture():
    return make_requests


@pytest.fixture(name="max_diff")
def _max_diff_fixture():
    return max_diff


@pytest.fixture
def live_server(request):
    """Start `diffusion-rollout serve` (toy denoiser via the factory argument) on a free port
    in a background thread; yields (url, engine, toy). Use
    ``@pytest.mark.parametrize("live_server", [{"token": "s3cret"}], indirect=True)`` for options
    (``{"edit": True}`` serves the image-conditioned toy, ``{"denoiser": cls}`` any other,
    ``{"argv": [...]}`` adds serve flags such as limits). The server runs on the guarded
    uvicorn protocol of `diffusion_rollout.serving`, as `diffusion-rollout serve` does."""
    import socket
    import time

    import uvicorn

    from diffusion_rollout.cli import build_parser, build_server
    from diffusion_rollout.serving import uvicorn_config

    opts = getattr(request, "param", {}) or {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        "serve",
        "--model",
        "toy",
        "--port",
        str(port),
        "--max-num-seqs",
        "8",
        "--max-wait-ms",
        str(opts.get("max_wait_ms", 20)),
    ]
    if opts.get("token"):
        argv += ["--token", opts["token"]]
    argv += [str(a) for a in opts.get("argv", [])]  # e.g. ["--max-steps", 8]
    args = build_parser().parse_args(argv)
    toy = (
        opts["denoiser"]()
        if "denoiser" in opts
        else (ToyEditDenoiser() if opts.get("edit") else ToyDenoiser())
    )
    app, engine = build_server(args, denoiser_factory=lambda path, device: toy)
    config = uvicorn_config(
        app, host="127.0.0.1", port=port, limits=app.state.limits.http, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", engine, toy
    server.should_exit = True
    thread.join(10)
    engine.close()
