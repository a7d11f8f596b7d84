"""Reward throughput, measured side by side in one run and printed as ratios.

    python benchmarks/rewards.py [--images 16] [--latents 256] [--repeats 3]

1. ocr: images/s scoring a batch at once (detection per image, text lines of all images
   recognised in shared batches) versus one image per call.
2. jpeg: images/s of jpeg_compressibility next to ocr.
3. latent: images/s of the distilled latent scorer on clean latents versus decoding them with
   the tiny SD3 VAE (omni_adapters.tiny, or an equally shaped diffusers AutoencoderKL when
   omni-adapters is not installed) and scoring the images with the teacher; plus the
   scorer's rank correlation with the teacher on held-out latents.

Only ratios and rates measured here are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from omni_rewards import load_reward


def render(text: str, size: int = 32) -> np.ndarray:
    font = ImageFont.load_default(size=size)
    left, t, r, b = ImageDraw.Draw(Image.new("RGB", (1, 1))).textbbox((0, 0), text, font=font)
    img = Image.new("RGB", (r - left + 40, b - t + 40), "white")
    ImageDraw.Draw(img).text((20 - left, 20 - t), text, fill="black", font=font)
    return np.asarray(img)


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def tiny_sd3_vae(tmp: Path):
    import torch
    from diffusers import AutoencoderKL

    try:
        from omni_adapters import tiny

        path = tiny.build("sd3", tmp / "sd3")
        vae = AutoencoderKL.from_pretrained(path / "vae")
        source = "omni_adapters.tiny.build('sd3')"
    except Exception as e:
        torch.manual_seed(0)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3,
            block_out_channels=(8, 16, 16),
            layers_per_block=1,
            latent_channels=16,
            norm_num_groups=4,
            sample_size=32,
            scaling_factor=1.5305,
            shift_factor=0.0609,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        source = f"diffusers AutoencoderKL with the tiny SD3 shape ({type(e).__name__}: {e})"
    return vae.eval(), source


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--latents", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    args = p.parse_args()
    os.environ.setdefault("HOME", tempfile.mkdtemp())
    rows: list[tuple[str, float]] = []

    # ---- ocr: batch vs one by one, and jpeg alongside ----
    words = [
        "Hello World",
        "OPEN 24 HOURS",
        "coffee",
        "Route 66",
        "Mind the gap",
        "EXIT",
        "sale 50%",
        "Library",
    ]
    imgs = [render(words[i % len(words)]) for i in range(args.images)]
    prompts = [f'"{words[i % len(words)]}"' for i in range(args.images)]
    ocr = load_reward("ocr", batch_size=args.images)
    ocr(images=imgs[:2], prompts=prompts[:2])  # warm-up (model load)
    t_batch = best_of(lambda: ocr(images=imgs, prompts=prompts), args.repeats)
    t_single = best_of(
        lambda: [ocr(images=[im], prompts=[pr]) for im, pr in zip(imgs, prompts)], args.repeats
    )
    jpeg = load_reward("jpeg_compressibility")
    t_jpeg = best_of(lambda: jpeg(images=imgs), args.repeats)
    n = len(imgs)
    rows += [
        ("ocr batch img/s", n / t_batch),
        ("ocr one-by-one img/s", n / t_single),
        ("jpeg img/s", n / t_jpeg),
    ]
    print(
        f"ocr:  batch {n / t_batch:8.2f} img/s | one by one {n / t_single:8.2f} img/s | batch / one-by-one = {t_single / t_batch:.2f}x"
    )
    print(f"jpeg: {n / t_jpeg:8.1f} img/s | jpeg / ocr-batch = {t_batch / t_jpeg:.1f}x")

    # ---- latent scorer vs decode + score ----
    try:
        import torch
    except ImportError:
        print("latent: skipped (torch not installed)")
        return 0
    from omni_rewards.latent import distill_latent, save_scorer, spearman

    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        vae, source = tiny_sd3_vae(Path(tmp))
        sf, sh = vae.config.scaling_factor, vae.config.shift_factor or 0.0
        g = torch.Generator().manual_seed(0)
        total = args.latents + 128
        z = torch.randn(total, vae.config.latent_channels, 8, 8, generator=g)
        z = z + torch.randn(total, vae.config.latent_channels, 1, 1, generator=g)

        def decode(latents: torch.Tensor) -> np.ndarray:
            with torch.no_grad():
                x = vae.decode(latents / sf + sh).sample
            return (
                ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
            )

        teacher = load_reward("brightness")
        images = decode(z)
        model, cfg, report = distill_latent(
            teacher, z.numpy(), images, steps=300, hidden=32, teacher_name="brightness"
        )
        scorer_dir = save_scorer(model, cfg, Path(tmp) / "scorer", report)
        lrm = load_reward("latent", path=str(scorer_dir), batch_size=args.latents)
        zb = z[: args.latents]
        t_decode = best_of(lambda: teacher(images=decode(zb)), args.repeats)
        t_latent = best_of(lambda: lrm(latents=zb.numpy()), args.repeats)
        held = z[args.latents :]
        rho = spearman(lrm(latents=held.numpy()).scores, teacher(images=decode(held)).scores)
    m = args.latents
    print(f"latent: VAE = {source}; torch threads = {torch.get_num_threads()}")
    print(
        f"latent: scorer {m / t_latent:8.1f} img/s | decode+brightness {m / t_decode:8.1f} img/s | "
        f"scorer / decode+score = {t_decode / t_latent:.1f}x"
    )
    print(
        f"latent: spearman with the teacher on {len(held)} fresh latents = {rho:.3f} "
        f"(distill held-out {report['spearman']:.3f}, pairwise acc {report['pairwise_accuracy']:.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
