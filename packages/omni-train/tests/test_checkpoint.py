from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    optimizer_state_from_safe,
    optimizer_state_to_safe,
    save_checkpoint,
)


def _model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    return m, opt


def test_optimizer_state_roundtrip_continues_identically() -> None:
    m, opt = _model_and_opt()
    tensors, meta = optimizer_state_to_safe(opt.state_dict())
    json.dumps(meta)  # JSON-able, no pickle
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    m2.load_state_dict(m.state_dict())
    opt2 = torch.optim.AdamW(m2.parameters(), lr=5.0)
    opt2.load_state_dict(optimizer_state_from_safe(tensors, meta))
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-2)
    x = torch.randn(5, 4)
    for mm, oo in ((m, opt), (m2, opt2)):
        oo.zero_grad()
        mm(x).pow(2).sum().backward()
        oo.step()
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_roundtrip_and_rng(tmp_path: Path) -> None:
    m, opt = _model_and_opt()
    params = dict(m.named_parameters())
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(7)
    path = save_checkpoint(
        tmp_path / "ck",
        3,
        params,
        opt.state_dict(),
        state={"version": 3},
        lora_tensors={"a.lora_A.weight": torch.ones(2, 2)},
        lora_config={"r": 2},
    )
    assert path.name == "step_0003"
    assert not list(path.glob("*.pt")) and not list(path.glob("*.pkl"))
    expect = (torch.rand(3), np.random.rand(2), random.random())
    torch.manual_seed(999)
    np.random.seed(1)
    random.seed(2)
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.step == 3 and ck.state["version"] == 3
    for k, p in params.items():
        assert torch.equal(ck.trainable[k], p.detach())
    ck.restore_rng()
    got = (torch.rand(3), np.random.rand(2), random.random())
    assert torch.equal(expect[0], got[0])
    assert np.array_equal(expect[1], got[1])
    assert expect[2] == got[2]
    assert (path / "lora" / "adapter_model.safetensors").is_file()
    assert json.loads((path / "lora" / "adapter_config.json").read_text()) == {"r": 2}


def test_latest_and_pruning(tmp_path: Path) -> None:
    m, opt = _model_and_opt()
    params = dict(m.named_parameters())
    for step in (1, 2, 3):
        save_checkpoint(tmp_path / "ck", step, params, opt.state_dict(), keep=2)
    names = sorted(p.name for p in (tmp_path / "ck").glob("step_*"))
    assert names == ["step_0002", "step_0003"]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step_0003"
    # a crash mid-save leaves a temp dir and no state.json: latest is still the old one
    broken = tmp_path / "ck" / ".tmp-step_0004-1"
    broken.mkdir()
    (broken / "trainable.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path / "ck").name == "step_0003"
    # a dangling `latest` falls back to the newest complete one
    (tmp_path / "ck" / "latest").write_text("step_0009\n")
    assert latest_checkpoint(tmp_path / "ck").name == "step_0003"
    # re-saving an existing step replaces it
    save_checkpoint(tmp_path / "ck", 3, params, opt.state_dict(), state={"again": True})
    assert load_checkpoint(tmp_path / "ck").state["again"] is True
