"""benchmarks/trained_forward.py: its five modes compute the same velocity (so the table compares
equal work), the ones that train keep a graph that reaches the LoRA, and `child` (what each
timing process runs) times a mode."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch
from diffusers import SD3Transformer2DModel

from omni_adapters import tiny

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "trained_forward.py"


def test_the_modes_agree_and_the_trained_ones_keep_a_graph(tmp_path):
    bench = runpy.run_path(str(SCRIPT))  # the script's names, without running main()
    path = tiny.build("sd3", tmp_path / "sd3", seed=0)
    outs, grads = {}, {}
    for mode in bench["MODES"]:
        model = bench["build_mode"](mode, path)
        out = bench["forward"](mode, model, bench["inputs"](model, 2))
        assert (out.grad_fn is not None) == (mode in bench["TRAINED_MODES"]), mode
        if mode in ("folded", "peft-grad"):
            out.square().sum().backward()
            grads[mode] = {n: p.grad for n, p in model.named_parameters() if ".lora_" in n}
        outs[mode] = out.detach()
    # the LoRA changes the output (the merge is not a no-op), and every mode matches it
    plain = SD3Transformer2DModel.from_pretrained(path / "transformer").eval()
    with torch.no_grad():
        base_out = plain(**bench["inputs"](plain, 2), return_dict=False)[0]
    assert (base_out - outs["merged"]).abs().max() > 1e-3
    for mode, out in outs.items():
        torch.testing.assert_close(out, outs["merged"], rtol=1e-5, atol=1e-5, msg=mode)
    # the reuse rollout's trained forward and the reference's replay train the same LoRA
    assert grads["folded"].keys() == grads["peft-grad"].keys()
    assert sum(g.abs().sum() for g in grads["folded"].values() if g is not None) > 0
    for name, g in grads["folded"].items():
        ref = grads["peft-grad"][name]
        assert (g is None) == (ref is None), name
        if g is not None:
            torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5, msg=name)


def test_a_child_times_a_mode(tmp_path):
    bench = runpy.run_path(str(SCRIPT))
    path = tiny.build("sd3", tmp_path / "sd3", seed=0)
    threads = torch.get_num_threads()
    try:
        assert bench["child"]("folded", path, samples=2, iters=1, threads=1) > 0
    finally:
        torch.set_num_threads(threads)
