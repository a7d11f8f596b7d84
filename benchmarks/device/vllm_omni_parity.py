"""The tiny SD3 through the real vllm-omni engine (AsyncOmni, its GPU worker process) and
through the embedded engine, side by side; prints the largest differences and exits non-zero
when they exceed the tolerance. Needs a CUDA GPU and the lock's vllm-omni environment; run it
with vllm_omni_parity.sh (one command, a few minutes with a warm uv cache).

What it checks, on the GPU, that the CPU contract tests (packages/diffusion-rollout/tests/
test_vllm_backend.py) cannot: vllm-omni's engine process starts our custom pipeline from
`engine_args`, co-batches the requests, ships the payload/metadata envelope back through its
IPC, and the weight-sync RPC reaches the worker.

    python benchmarks/device/vllm_omni_parity.py [--requests 16] [--tol 1e-3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tol", type=float, default=1e-3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    # The embedded engine runs full float32 matmuls, like the engine's worker in float32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    import omni_adapters
    from diffusion_rollout import EmbeddedEngine, RolloutRequest, SamplingParams, VllmOmniEngine

    path = str(omni_adapters.tiny.build("sd3", tempfile.mkdtemp() + "/tiny-sd3"))
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["to_q", "to_v"]}
    params = SamplingParams(
        height=64,
        width=64,
        num_steps=8,
        guidance_scale=3.0,
        sde_window_size=2,
        sde_window_range=(0, 6),
        output="both",
    )
    n = args.requests
    requests = [
        RolloutRequest(f"a red fox {i % 4}", 100 + i, params, f"p{i}", negative_prompt="blurry")
        for i in range(n)
    ]

    trainer = omni_adapters.from_pretrained(path)
    trainer.add_lora(lora["rank"], lora["alpha"], target_modules=lora["target_modules"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.trainable_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    weights = trainer.export_rollout_weights()

    reference = omni_adapters.from_pretrained(path, device="cuda")
    reference.add_lora(lora["rank"], lora["alpha"], target_modules=lora["target_modules"])

    rows = []
    t0 = time.perf_counter()
    with (
        VllmOmniEngine(path, lora_config=lora, max_num_seqs=8, num_gpus=1) as engine,
        EmbeddedEngine(reference, max_num_seqs=8) as embedded,
    ):
        start_s = time.perf_counter() - t0
        for version in (0, 1):
            if version:
                engine.update_weights(weights, version)
                embedded.update_weights(weights, version)
            t = time.perf_counter()
            got = engine.generate_many(requests)
            omni_s = time.perf_counter() - t
            want = embedded.generate_many(requests)
            diff = {
                name: max(
                    (getattr(a, name).cpu() - getattr(b, name).cpu()).abs().max().item()
                    for a, b in zip(want, got)
                )
                for name in ("latents", "log_probs", "final_latent")
            }
            media = max(
                (a.media.cpu().int() - b.media.cpu().int()).abs().max().item()
                for a, b in zip(want, got)
            )
            versions = {t.version for t in got}
            rows.append((version, diff, media, versions, omni_s))
    print(f"vllm-omni engine start {start_s:.1f} s, {n} requests per version")
    print("| version | max latent diff | max log-prob diff | max final diff | max media diff | s |")
    ok = True
    for version, diff, media, versions, s in rows:
        print(
            f"| {version} | {diff['latents']:.2e} | {diff['log_probs']:.2e} | "
            f"{diff['final_latent']:.2e} | {media} | {s:.2f} |"
        )
        ok &= versions == {version} and max(diff.values()) <= args.tol
    print("PASS" if ok else f"FAIL (tolerance {args.tol})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
