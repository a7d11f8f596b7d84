"""Our training-forward kernels against the libraries' on a CPU, forward + backward, each side in
its own process, interleaved: the folded LoRA linear (omni_adapters.lora_folding) against
peft's, the two product orders of its dB, and the fused RMSNorm
(omni_adapters.rms_norm_fusing) against diffusers'.

Sides (one process per side, shape and round; rounds in rotating order):

- ``lora-peft``: peft's ``lora.Linear`` (base matmul + two thin matmuls + scale + add),
  base weight frozen, an input that takes a gradient (as inside a model).
- ``lora-folded``: the same layer after ``fold_lora_linears`` (one matmul with ``W + s B A``).
- ``db-gT``: only the dB product as ``g^T (s x A^T)`` (out x rows times rows x rank).
- ``db-xT``: only the dB product as ``((s x A^T)^T g)^T``, the order the folded backward uses.
- ``rms-diffusers`` / ``rms-fused``: diffusers' ``RMSNorm`` (frozen weight) over the q/k
  heads, a (rows, heads, tokens, 32) transposed view as in diffusers' joint attention, before
  and after ``fuse_rms_norms``.

Shapes: the packed replay forward of the CPU-sized SD3 of benchmarks/vs_reference_loop.py
(336 samples x 32 text tokens = 10752 rows; widths of its projections; 4 heads of 32, with
its 16 image and 32 text tokens for the norms).

    uv run python benchmarks/training_kernels.py
    uv run python benchmarks/training_kernels.py --samples 48 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LORA_SIDES = ("lora-peft", "lora-folded", "db-gT", "db-xT")
RMS_SIDES = ("rms-diffusers", "rms-fused")
SIDES = LORA_SIDES + RMS_SIDES
LORA_SHAPES = [(128, 128), (128, 512), (512, 128)]  # (in, out): attention, ff up, ff down
RMS_TOKENS = [16, 32]  # image and text tokens of the CPU-sized SD3 at 32x32
TEXT_TOKENS, HEADS, HEAD_DIM = 32, 4, 32
RANK, ALPHA = 8, 16.0


def child(side: str, samples: int, shape: tuple[int, int], iters: int, threads: int) -> float:
    """Seconds per forward + backward (or per product, for the dB sides) of one side."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if side in RMS_SIDES:
        from diffusers.models.normalization import RMSNorm

        from omni_adapters.rms_norm_fusing import fuse_rms_norms

        tokens = shape[0]
        heads = torch.randn(samples, tokens, HEADS, HEAD_DIM).transpose(1, 2)
        g = torch.randn(heads.shape)
        model = torch.nn.Sequential(RMSNorm(HEAD_DIM, eps=1e-6))
        model[0].weight.requires_grad_(False)
        if side == "rms-fused":
            assert fuse_rms_norms(model) == 1
        xg = heads.detach().requires_grad_(True)

        def once() -> None:
            model(xg).backward(g)

    else:
        d_in, d_out = shape
        rows = samples * TEXT_TOKENS
        x = torch.randn(rows, d_in)
        g = torch.randn(rows, d_out)
        if side.startswith("db-"):
            a = torch.randn(RANK, d_in)
            s = ALPHA / RANK

            def once() -> None:
                xa = (x @ a.t()).mul_(s)
                if side == "db-gT":
                    g.t() @ xa
                else:
                    (xa.t() @ g).t()

        else:
            from peft import LoraConfig, inject_adapter_in_model

            from omni_adapters.lora_folding import fold_lora_linears

            model = torch.nn.Sequential(torch.nn.Linear(d_in, d_out))
            cfg = LoraConfig(
                r=RANK, lora_alpha=ALPHA, target_modules=["0"], init_lora_weights=False
            )
            model = inject_adapter_in_model(cfg, model)
            for name, p in model.named_parameters():
                p.requires_grad_("lora_" in name)
            if side == "lora-folded":
                assert fold_lora_linears(model) == 1
            xg = x.clone().requires_grad_(True)

            def once() -> None:
                model(xg).backward(g)

    for _ in range(3):
        once()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    return (time.perf_counter() - t0) / iters


def _rounds(sides, shape, a) -> dict[str, float]:
    got: dict[str, list[float]] = {side: [] for side in sides}
    for rep in range(a.repeats):
        k = rep % len(sides)
        for side in sides[k:] + sides[:k]:
            cmd = [sys.executable, __file__, "--child", side]
            cmd += ["--shape", "x".join(map(str, shape)), "--samples", str(a.samples)]
            cmd += ["--iters", str(a.iters), "--threads", str(a.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            got[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {side: statistics.median(v) * 1e3 for side, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=336, help="samples in one forward")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per process")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per side")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        shape = tuple(int(v) for v in a.shape.split("x"))
        print(json.dumps(child(a.child, a.samples, shape, a.iters, a.threads)))
        return 0
    load0 = os.getloadavg()
    lora = [(shape, _rounds(LORA_SIDES, shape, a)) for shape in LORA_SHAPES]
    rms = [(tokens, _rounds(RMS_SIDES, (tokens,), a)) for tokens in RMS_TOKENS]
    load1 = os.getloadavg()
    print(
        f"{a.samples} samples a forward, LoRA rank {RANK}, {a.threads} torch threads, median "
        f"of {a.repeats} interleaved process rounds x {a.iters} calls; load average "
        f"{load0[0]:.1f} before, {load1[0]:.1f} after\n"
    )
    print(f"LoRA linear, {a.samples * TEXT_TOKENS} rows, forward + backward:\n")
    print(
        "| in x out | peft ms | folded ms | peft / folded | dB g^T(s xA^T) ms | "
        "dB ((s xA^T)^T g)^T ms | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for (d_in, d_out), ms in lora:
        print(
            f"| {d_in} x {d_out} | {ms['lora-peft']:.2f} | {ms['lora-folded']:.2f} | "
            f"{ms['lora-peft'] / ms['lora-folded']:.2f}x | {ms['db-gT']:.2f} | "
            f"{ms['db-xT']:.2f} | {ms['db-gT'] / ms['db-xT']:.2f}x |"
        )
    print(f"\nRMSNorm over ({a.samples}, {HEADS}, tokens, {HEAD_DIM}), forward + backward:\n")
    print("| tokens | diffusers ms | fused ms | diffusers / fused |")
    print("|---|---|---|---|")
    for tokens, ms in rms:
        print(
            f"| {tokens} | {ms['rms-diffusers']:.2f} | {ms['rms-fused']:.2f} | "
            f"{ms['rms-diffusers'] / ms['rms-fused']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
