"""rollout.backend: http: the loop drives a `diffusion-rollout serve` through the same port as
the embedded engine, pushes LoRA versions to it (the first push carries the LoRA config), and
gets the embedded run's trajectories; a server started by omni-train stops with the run; a
server killed mid-run ends the run with one clear error, never a hang."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from omni_train_testutils import minimal_recipe

from omni_train import train
from omni_train.errors import TrainError
from omni_train.recipe import recipe_from_dict

pytest.importorskip("httpx")


def _recipe(
    tmp: Path, model: Path, trainer: dict | None = None, algorithm: dict | None = None, **rollout
) -> dict:
    sections = {
        "rollout": {"sde_window_range": [0, 3], "noise_level": 0.8, **rollout},
        "algorithm": {"name": "flow_grpo", "clip_range": 0.2, **(algorithm or {})},
        "optimizer": {"lr": 2e-2},
    }
    return minimal_recipe(tmp, model, sections, **{"steps": 3, **(trainer or {})})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(model: Path) -> tuple[str, subprocess.Popen]:
    """A `diffusion-rollout serve` started as a user would, apart from the trainer."""
    from diffusion_rollout import RolloutClient

    port = _free_port()
    log = tempfile.TemporaryFile()  # noqa: SIM115 (its stderr, shown if it dies at start-up)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "diffusion_rollout.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # a busy machine loads torch slowly
    while True:
        try:
            RolloutClient(url).wait_ready(timeout_s=5)
            return url, proc
        except TimeoutError:
            if proc.poll() is not None:  # it died at start-up: say so now, not in 10 minutes
                log.seek(0)
                err = log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(
                    f"diffusion-rollout serve exited with {proc.returncode}: {err}"
                ) from None
            if time.monotonic() > deadline:
                proc.kill()
                raise


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_http_rollout_trains_like_the_embedded_engine(tmp_path, tiny_sd3, monkeypatch):
    """The same run on a server the user started (rollout.url) and on the embedded engine,
    killed after its third step and resumed against the same server, which outlived the
    killed run: versions only go up there, so the resumed run's pushes are shifted past the
    version the server holds, and the run ends as the embedded one does. A new run on that
    server, which holds the earlier run's weights, is refused by name.

    Both runs correct for the rollout engine (`algorithm.rollout_correction: decoupled`, the
    setting for an engine apart from the trainer): the log-probs the server sends back are the
    ones the trainer recomputes, step for step of the window."""
    from omni_train import resume
    from omni_train.logger import read_metrics
    from omni_train.loops.diffusion import DiffusionLoop

    common = {"steps": 4, "save_every": 2}
    decoupled = {"rollout_correction": "decoupled"}
    embedded = train(recipe_from_dict(_recipe(tmp_path / "e", tiny_sd3, common, decoupled)))
    url, proc = _serve(tiny_sd3)
    run = tmp_path / "h"
    orig = DiffusionLoop.train_step

    def dying(self, step, rollout):
        row = orig(self, step, rollout)
        if step == 2:  # pushed version 3; the last checkpoint holds version 2
            raise KeyboardInterrupt
        return row

    try:
        recipe = recipe_from_dict(
            _recipe(run, tiny_sd3, common, decoupled, backend="http", url=url)
        )
        monkeypatch.setattr(DiffusionLoop, "train_step", dying)
        with pytest.raises(KeyboardInterrupt):
            train(recipe)
        monkeypatch.setattr(DiffusionLoop, "train_step", orig)
        resume(run)  # the server holds 3; the checkpoint's 2 goes to it as 4, then 5, 6
        with pytest.raises(TrainError, match=r"rollout\.url: .*already holds weights version 6"):
            train(recipe_from_dict(_recipe(tmp_path / "new", tiny_sd3, backend="http", url=url)))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    served = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in served] == [1, 2, 3, 4]
    assert [r["weights/version"] for r in served] == [1, 2, 3, 4]
    assert [r["rollout/version"] for r in served] == [0, 1, 2, 3]  # the run's own numbering
    # same seeds, same weights: the same trajectories, so the same rewards and updates
    for a, b in zip(embedded, served, strict=True):
        for k in (
            "reward/mean",
            "reward/std",
            "reward/min",
            "reward/max",
            "loss",
            "actor/grad_norm",
            "correction/is_weight_mean",
        ):
            assert b[k] == pytest.approx(a[k], abs=1e-5), (k, a[k], b[k])
        # the server's log-probs are the trainer's own, on the same rows and window steps
        assert b["correction/logprob_abs_diff_max"] < 1e-4
        assert b["correction/rejected_frac"] == 0.0
    assert served[-1]["reward/mean"] != served[0]["reward/mean"]  # the pushed LoRA is in use


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_server_started_by_omni_train_and_a_killed_server(tmp_path, tiny_sd3):
    # rollout.url null: omni-train starts the server on loopback and stops it with the run
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    rows = train(recipe_from_dict(_recipe(tmp_path / "auto", tiny_sd3, backend="http")))
    assert len(rows) == 3
    after = {p for p in os.listdir("/proc") if p.isdigit()}
    for pid in after - before:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert b"diffusion_rollout.cli" not in cmd, "the started server outlived the run"

    # a server killed mid-run: one clear error naming rollout.backend, in bounded time
    url, proc = _serve(tiny_sd3)
    try:
        recipe = recipe_from_dict(
            _recipe(tmp_path / "killed", tiny_sd3, backend="http", url=url)
            | {
                "trainer": {
                    "steps": 50,
                    "progress": False,
                    "sample_every": 0,
                    "output_dir": str(tmp_path / "killed"),
                }
            }
        )
        import threading

        def kill_after_first_step() -> None:
            metrics = tmp_path / "killed" / "metrics.jsonl"
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline and not (metrics.is_file() and metrics.read_text()):
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_after_first_step)
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(
            TrainError, match=r"rollout\.backend: .* on http://127\.0\.0\.1:\d+ failed"
        ):
            train(recipe)
        assert time.monotonic() - t0 < 900
        killer.join()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_the_server_omni_train_starts_loads_the_model_as_the_trainer_does(tmp_path, tiny_sd3):
    """The `diffusion-rollout serve` command of a run without `rollout.url`, read by that
    command's own parser: the trainer's `model.device`, `model.dtype` and `model.options`
    (they were once left out: the server loaded float32 under a bfloat16 learner)."""
    import json

    from diffusion_rollout.cli import build_parser
    from omni_train.backends.remote_rollout import server_command

    d = _recipe(tmp_path, tiny_sd3, backend="http", max_num_seqs=8)
    d["model"].update(dtype="bfloat16", options={"gradient_checkpointing": True})
    cmd = server_command(recipe_from_dict(d), tiny_sd3, 8123)
    assert cmd[:3] == [sys.executable, "-m", "diffusion_rollout.cli"]
    args = build_parser().parse_args(cmd[3:])
    assert (args.model, args.port, args.max_num_seqs) == (str(tiny_sd3), 8123, 8)
    assert (args.device, args.dtype) == ("cpu", "bfloat16")
    assert json.loads(args.model_options) == {"gradient_checkpointing": True}
