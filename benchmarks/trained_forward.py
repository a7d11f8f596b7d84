"""Where a trained forward's time goes: one forward of an SD3 transformer in each of the ways
the two loops of benchmarks/vs_reference_loop.py run it, each way in its own process,
rounds interleaved in rotating order.

Modes (the same transformer, the same LoRA, the same inputs; all compute the same velocity):

- ``merged``: ours, the rollout forwards that train nothing: the merged rollout copy
  (`OmniModelBase.merged_rollout_copy`, the LoRA in the weights), no autograd.
- ``merged-graph``: the same merged weights with autograd kept through an input that takes
  a gradient: what the graph alone costs, the floor of any forward that trains.
- ``folded``: ours, a trained forward of the reuse rollout (`algorithm.reuse_rollout_forward`):
  the learner as `add_lora` leaves it (LoRA folded into the matmul's weight,
  `omni_adapters.lora_folding`; fused RMSNorms) with autograd.
- ``peft``: the reference's rollout forward: diffusers' transformer with a peft LoRA left
  unmerged, no autograd.
- ``peft-grad``: the reference's replay forward: the same with autograd.

Models: those of benchmarks/vs_reference_loop.py (``tiny``, ``cpu``, ``cpu-large``), the
LoRA it trains (rank 8, alpha 16, the SD3 family's default targets), its 32x32 images and 32
text tokens. The table gives ms per forward (median of ``--iters`` calls a process, median
over rounds) and each mode over ``merged``: ``folded`` / ``merged`` is what a trained step
costs the reuse rollout over the steps it does not train.

    uv run python benchmarks/trained_forward.py
    uv run python benchmarks/trained_forward.py --models cpu --samples 48 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("merged", "merged-graph", "folded", "peft", "peft-grad")
TRAINED_MODES = ("merged-graph", "folded", "peft-grad")  # forwards that keep a graph
RANK, ALPHA = 8, 16.0
TEXT_TOKENS = 32
LORA_STD = 0.02  # LoRA factors drawn at this scale, so that the merge changes the weights


def _fill_lora(module: Any) -> None:
    """Deterministic LoRA factors by parameter name: the same in every process and mode."""
    import torch

    with torch.no_grad():
        names = sorted(n for n, _ in module.named_parameters() if ".lora_" in n)
        for i, name in enumerate(names):
            p = module.get_parameter(name)
            gen = torch.Generator().manual_seed(i)
            p.copy_(torch.randn(p.shape, generator=gen) * LORA_STD)


def build_mode(mode: str, path: Path) -> Any:
    """The transformer (an ``nn.Module``) a mode runs, with the benchmark's LoRA."""
    import omni_adapters

    if mode in ("peft", "peft-grad"):
        from diffusers import SD3Transformer2DModel
        from peft import LoraConfig, inject_adapter_in_model

        from omni_adapters.families.sd3 import SD3_LORA_TARGETS

        model = SD3Transformer2DModel.from_pretrained(path / "transformer")
        cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(SD3_LORA_TARGETS))
        inject_adapter_in_model(cfg, model)
        for name, p in model.named_parameters():
            p.requires_grad_(".lora_" in name)
        _fill_lora(model)
        return model.eval()
    adapter = omni_adapters.from_pretrained(path)
    adapter.add_lora(RANK, ALPHA)
    _fill_lora(adapter.model)
    if mode == "folded":
        return adapter.model.eval()
    return adapter.merged_rollout_copy().model.eval()


def inputs(model: Any, samples: int) -> dict[str, Any]:
    """Random inputs of the benchmark's shapes (seeded: the same in every mode)."""
    import torch

    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    hw = cfg.sample_size
    return {
        "hidden_states": torch.randn(samples, cfg.in_channels, hw, hw, generator=gen),
        "encoder_hidden_states": torch.randn(
            samples, TEXT_TOKENS, cfg.joint_attention_dim, generator=gen
        ),
        "pooled_projections": torch.randn(samples, cfg.pooled_projection_dim, generator=gen),
        "timestep": torch.full((samples,), 500.0),
    }


def forward(mode: str, model: Any, args: dict[str, Any]) -> Any:
    """One forward as the mode runs it; the output keeps its graph where the mode trains."""
    import torch

    args = dict(args)
    if mode == "merged-graph":
        args["hidden_states"] = args["hidden_states"].clone().requires_grad_(True)
    grad = mode in TRAINED_MODES
    with torch.set_grad_enabled(grad):
        out = model(**args, return_dict=False)[0]
    if grad and out.grad_fn is None:
        raise RuntimeError(f"{mode}: the forward kept no graph")
    return out


def child(mode: str, path: Path, samples: int, iters: int, threads: int) -> float:
    """Median seconds of one forward of ``mode`` (after two untimed ones)."""
    import torch

    torch.set_num_threads(threads)
    model = build_mode(mode, path)
    args = inputs(model, samples)
    for _ in range(2):
        forward(mode, model, args)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = forward(mode, model, args)
        times.append(time.perf_counter() - t0)
        del out  # the graph goes before the next forward, as after a backward
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,cpu,cpu-large", help="of vs_reference_loop.py")
    ap.add_argument("--samples", type=int, default=48, help="rows in one forward")
    ap.add_argument("--iters", type=int, default=9, help="timed forwards per process")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, Path(a.path), a.samples, a.iters, a.threads)))
        return 0
    from vs_reference_loop import build_models  # benchmarks/ is the script's folder

    names = a.models.split(",")
    load0 = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_models(Path(tmp), names)
        for name in names:
            got: dict[str, list[float]] = {m: [] for m in MODES}
            for rep in range(a.repeats):
                k = rep % len(MODES)
                for mode in MODES[k:] + MODES[:k]:
                    cmd = [sys.executable, __file__, "--child", mode, "--path", str(paths[name])]
                    cmd += ["--samples", str(a.samples), "--iters", str(a.iters)]
                    cmd += ["--threads", str(a.threads)]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    got[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            rows.append((name, {m: statistics.median(v) * 1e3 for m, v in got.items()}))
    load1 = os.getloadavg()
    print(
        f"one forward of {a.samples} rows (32x32 images, {TEXT_TOKENS} text tokens), LoRA rank "
        f"{RANK}, {a.threads} torch threads; median of {a.iters} forwards a process, of "
        f"{a.repeats} interleaved rounds; load average {load0[0]:.1f} before, {load1[0]:.1f} after\n"
    )
    print(
        "| model | "
        + " | ".join(f"{m} ms" for m in MODES)
        + " | "
        + " | ".join(f"{m} / merged" for m in MODES[1:])
        + " |"
    )
    print("|---" * (2 * len(MODES)) + "|")
    for name, ms in rows:
        cells = [f"{ms[m]:.1f}" for m in MODES] + [
            f"{ms[m] / ms['merged']:.2f}x" for m in MODES[1:]
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
