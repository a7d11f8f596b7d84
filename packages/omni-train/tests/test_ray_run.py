"""The tiny random SD3 recipe on trainer.backend ray, end to end through the CLI: validation,
sample grids, checkpoints with the optimizer state, and a SIGKILLed run resumed (`omni-train
resume`) on the backend it ran on ends with the metrics of the uninterrupted run (as MixGRPO,
whose window moves every step); and FlowGRPO with the http rollout, full fine-tuning and
guidance.

The runs connect to the test session's Ray cluster (RAY_ADDRESS), so killing a run's driver
takes its actors with it and leaves the cluster for the next run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omni_train_testutils import without_timings
from safetensors import safe_open

from omni_train.logger import read_metrics

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[3]
TINY_RECIPE = REPO / "recipes" / "tiny" / "sd3_brightness_flowgrpo.yaml"

OVERRIDES = [
    "trainer.backend=ray",
    "trainer.num_workers=2",
    "trainer.steps=4",
    "trainer.val_every=2",
    "trainer.save_every=2",
    "trainer.progress=false",
    "trainer.threads=1",
]


def _cli(args: list[str], ray_address: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_ADDRESS=ray_address)
    return subprocess.Popen(
        [sys.executable, "-m", "omni_train.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 1200) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


#: MixGRPO with its window moving every step: the rollout workers get each step's window,
#: and a resumed run must put it where the uninterrupted run had it
MIX_GRPO = [
    "algorithm.name=mix_grpo",
    "rollout.sde_window_size=1",
    "algorithm.mix_window.shift_interval=1",
]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # three CLI runs, each starting Python, torch and five Ray workers
def test_tiny_recipe_on_ray_validates_saves_and_resumes_after_sigkill(ray_session, tmp_path):
    address = ray_session.get_runtime_context().gcs_address
    full = tmp_path / "full"
    _finish(_cli([str(TINY_RECIPE), *OVERRIDES, *MIX_GRPO, f"trainer.output_dir={full}"], address))
    rows = read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # 0: the validation baseline
    assert [r["rollout/window_start"] for r in rows[1:]] == [0.0, 1.0, 2.0, 3.0]
    assert all("val/reward_mean" in rows[i] for i in (0, 2, 4))
    assert (full / "samples" / "val_step_0002.png").is_file()
    assert (full / "samples" / "step_0001.png").is_file()
    ck = full / "checkpoint" / "step_0004"
    state = json.loads((ck / "state.json").read_text())
    assert state["backend"] == "ray" and state["version"] == 4
    with safe_open(str(ck / "optimizer.safetensors"), "pt") as f:  # the gathered AdamW moments
        names = f.keys()
        assert any(k.endswith("exp_avg_sq") for k in names)

    run = tmp_path / "killed"
    proc = _cli([str(TINY_RECIPE), *OVERRIDES, *MIX_GRPO, f"trainer.output_dir={run}"], address)
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (run / "checkpoint" / "step_0002" / "state.json").is_file():
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    done = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    # A kill between step 2's save and the append of its row leaves [0, 1]: resume writes
    # that row back from the checkpoint (RunFolder.save keeps it there).
    assert done in ([0, 1], [0, 1, 2], [0, 1, 2, 3]), f"not killed between steps 2 and 4: {done}"
    _finish(_cli(["resume", str(run)], address))
    resumed = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert without_timings(resumed) == without_timings(rows)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tiny_recipe_on_ray_full_finetune_guided_with_the_http_rollout(ray_session, tmp_path):
    """trainer.backend ray with rollout.backend http (rollout.url null), training a block of
    the transformer without LoRA, with guidance (as bagel_pickscore_flowgrpo trains on Ray):
    omni-train starts a `diffusion-rollout serve`, the FSDP ranks' full-weight shards are put
    together and reach it every step, validation (at steps 0 and 2) samples through it, and
    the checkpoint holds the gathered block with its AdamW moments."""
    address = ray_session.get_runtime_context().gcs_address
    run = tmp_path / "http"
    overrides = [o for o in OVERRIDES if not o.startswith(("trainer.steps", "trainer.save"))]
    overrides += [
        "trainer.steps=2",
        "trainer.save_every=2",
        "rollout.backend=http",
        "rollout.guidance_scale=2.0",
        "lora.enabled=false",
        r"lora.full_regex=.*transformer_blocks\.1\..*",
    ]
    _finish(_cli([str(TINY_RECIPE), *overrides, f"trainer.output_dir={run}"], address))
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("val/reward_mean" in rows[i] for i in (0, 2))
    assert [rows[i]["weights/version"] for i in (1, 2)] == [1, 2]
    ck = run / "checkpoint" / "step_0002"
    with safe_open(str(ck / "trainable.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all(n.startswith("transformer_blocks.1.") for n in names), names[:5]
    with safe_open(str(ck / "optimizer.safetensors"), "pt") as f:
        moments = f.keys()
    assert any(k.endswith("exp_avg_sq") for k in moments)
