"""The public API of omni_train, and the package README's custom-update example, run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import omni_train

README = Path(__file__).resolve().parents[1] / "README.md"


def test_public_names_import() -> None:
    for name in omni_train.__all__:
        assert hasattr(omni_train, name), name
    assert set(omni_train.ALGORITHMS) == {
        "flow_grpo",
        "dance_grpo",
        "mix_grpo",
        "flow_dppo",
        "grpo_guard",
        "diffusion_nft",
        "diffusion_dpo",
        "gspo",
        "grpo",
    }


def test_readme_custom_update_example_runs(tiny_sd3: Path) -> None:
    """The README's `one_update` on a tiny SD3 with LoRA and real rollouts moves the LoRA."""
    code = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(c for c in code if "def one_update" in c)
    scope: dict = {}
    exec(example, scope)
    from diffusion_rollout import EmbeddedEngine, RolloutRequest, SamplingParams
    from omni_adapters import from_pretrained

    adapter = from_pretrained(tiny_sd3)
    adapter.add_lora(4, 8)
    params = SamplingParams(height=32, width=32, num_steps=4, sde_window_size=2)
    with EmbeddedEngine(adapter) as engine:
        trajs = engine.generate_many([RolloutRequest("a red square", s, params) for s in range(4)])
    before = {k: v.detach().clone() for k, v in adapter.named_trainable_parameters().items()}
    metrics = scope["one_update"](adapter, trajs, [1.0, -1.0, 0.5, -0.5])
    assert metrics["rollout/logprob_diff_max"] < 1e-4 and "loss" in metrics
    after = adapter.named_trainable_parameters()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(KeyError):
        _ = omni_train.ALGORITHMS["kl_penalty"]
