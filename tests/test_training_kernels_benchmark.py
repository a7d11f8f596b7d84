"""benchmarks/training_kernels.py: every side runs (in process, at a few rows), and the two
orders of the folded backward's dB product it times are the same product."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "training_kernels.py"


def test_every_side_runs_and_the_db_orders_agree():
    bench = runpy.run_path(str(SCRIPT))  # the script's names, without running main()
    threads = torch.get_num_threads()
    try:
        for side in bench["LORA_SIDES"]:
            assert bench["child"](side, samples=2, shape=(16, 24), iters=1, threads=1) > 0
        for side in bench["RMS_SIDES"]:
            assert bench["child"](side, samples=2, shape=(5,), iters=1, threads=1) > 0
    finally:
        torch.set_num_threads(threads)
    x, g, a = torch.randn(64, 16), torch.randn(64, 32), torch.randn(bench["RANK"], 16)
    xa = x @ a.t()
    torch.testing.assert_close((xa.t() @ g).t(), g.t() @ xa, rtol=1e-5, atol=1e-5)
