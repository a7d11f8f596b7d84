from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omni_train_testutils import without_timings

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


# --- a damaged or half-written run: nothing lost, the newest good checkpoint, one clear line


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated tensors": lambda ck: (ck / "trainable.safetensors").write_bytes(
        (ck / "trainable.safetensors").read_bytes()[:100]
    ),
    "empty optimizer": lambda ck: (ck / "optimizer.safetensors").write_bytes(b""),
    "truncated state.json": lambda ck: (ck / "state.json").write_text('{"step": 3, "ver'),
    "wrong-typed step": lambda ck: (ck / "state.json").write_text('{"step": "three"}'),
    "missing optimizer.json": lambda ck: (ck / "optimizer.json").unlink(),
    "flipped byte": lambda ck: _flip_byte(ck / "trainable.safetensors"),
    "flipped rng byte": lambda ck: _flip_byte(ck / "rng.safetensors"),
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_sd3):
    """A 3-step run with a checkpoint after each step, and its metrics."""
    from omni_train_testutils import minimal_recipe

    from omni_train import train
    from omni_train.recipe import recipe_from_dict

    tmp = tmp_path_factory.mktemp("ck")
    d = minimal_recipe(tmp / "run", tiny_sd3, steps=3, save_every=1, keep_checkpoints=3)
    rows = train(recipe_from_dict(d))
    return tmp / "run", rows


@pytest.mark.parametrize("what", sorted(CORRUPTIONS))
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_good_one(
    what, finished_run, tmp_path, capsys
) -> None:
    from omni_train.cli import main
    from omni_train.logger import read_metrics

    src, rows = finished_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    CORRUPTIONS[what](run / "checkpoint" / "step_0003")
    assert main(["resume", str(run), "trainer.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "step_0003" in out and "falling back" in out, out
    # the summary after the run: where it is and its newest checkpoint, the one written anew
    assert f"finished: 3 steps in {run}" in out, out
    ck = run / "checkpoint" / "step_0003"
    assert f"newest checkpoint: {ck}\n" in out, out
    assert f"LoRA for diffusers (load_lora_weights): {ck / 'lora'}" in out, out
    on_disk = read_metrics(run / "metrics.jsonl")
    assert without_timings(on_disk) == without_timings(rows)  # step 3 trained again
    assert (run / "checkpoint" / "step_0003" / "manifest.json").is_file()  # and saved anew


def test_no_good_checkpoint_is_one_line(finished_run, tmp_path, capsys) -> None:
    from omni_train.cli import main

    src, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    for ck in (run / "checkpoint").glob("step_*"):
        (ck / "trainable.safetensors").write_bytes(b"")
    assert main(["resume", str(run)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint of" in err and "trainable.safetensors" in err


def test_cut_metrics_line_stale_saves_and_a_row_lost_between_save_and_log(
    finished_run, tmp_path
) -> None:
    """A kill can leave: a half-written last metrics line, a temp folder of a save, and a
    checkpoint whose step's row never reached metrics.jsonl. The resumed run ends with the
    uninterrupted run's metrics and no leftovers."""
    from omni_train import resume
    from omni_train.logger import read_metrics

    src, rows = finished_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    # the row of step 3 was never appended (killed right after its checkpoint), and the
    # append of a row before it was cut mid-line
    (run / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:20])
    (run / "checkpoint" / ".tmp-step_0004-999").mkdir()
    (run / "checkpoint" / ".tmp-step_0004-999" / "trainable.safetensors").write_bytes(b"x" * 64)
    resume(run, ["trainer.steps=3"])
    assert without_timings(read_metrics(run / "metrics.jsonl")) == without_timings(rows)
    assert not any(p.name.startswith(".tmp-") for p in (run / "checkpoint").iterdir())
