"""`rollout.backend: http | vllm-omni`: the rollout port on an engine outside the trainer.

- ``http``: a `diffusion-rollout serve` process, at `rollout.url` (started by the user, token
  in ``DIFFUSION_ROLLOUT_TOKEN``) or, with `rollout.url: null`, started here on a free loopback
  port with the recipe's model and stopped with the run.
- ``vllm-omni``: `diffusion_rollout.VllmOmniEngine` (vllm-omni's ``AsyncOmni``; a GPU).

Both are driven through `RemoteRollout`, the same port as the embedded engine: requests in,
trajectories out, and versioned weight sync. The first push carries the LoRA config (rank,
alpha, targets) so the served model adds the adapter the tensors fill. A server that stops
answering is retried by the client and then reported as one `TrainError` naming
`rollout.backend`; nothing waits forever.

A server the user started outlives runs. Its versions only go up, so a run resumed against
it (the server already at the killed run's last push, or past the checkpoint's version) has
its versions shifted past the server's at its first push, and shifted back on the
trajectories: the run sees its own numbering. A new run, which starts from the base model,
refuses a server that already holds pushed weights (they are an earlier run's policy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import TrainError
from ..recipe import Recipe

__all__ = ["RemoteRollout", "make_remote_rollout", "start_server"]

TOKEN_ENV = "DIFFUSION_ROLLOUT_TOKEN"


class RemoteRollout:
    """A rollout port over a `RolloutClient` (HTTP) or a `VllmOmniEngine`."""

    def __init__(self, target: Any, where: str, lora_config: dict[str, Any] | None) -> None:
        self.target = target
        self.where = where
        #: sent with the first weight push (a vllm-omni engine got it at start instead)
        self.lora_config = lora_config
        self._forwards = self._rows = 0
        self.closers: list[Any] = []
        #: the server's version minus the run's, fixed at the first push (None before it)
        self._shift: int | None = None

    def _fail(self, what: str, exc: BaseException) -> TrainError:
        return TrainError(f"rollout.backend: {what} on {self.where} failed: {exc}")

    def _served_version(self) -> int:
        try:
            return int(self.target.version)
        except Exception as exc:
            raise self._fail("reading the served weights version", exc) from None

    def generate_many(self, requests: list[Any]) -> list[Any]:
        if self._shift is None and (served := self._served_version()) > 0:
            raise TrainError(
                f"rollout.url: the server at {self.where} already holds weights version "
                f"{served}, pushed by an earlier run; this run starts from the base model, so "
                "it needs a server nobody has pushed to: restart it, or set rollout.url: null "
                "to have omni-train start one"
            )
        try:
            before = self.target.stats()
            trajs = self.target.generate_many(requests)
            after = self.target.stats()
        except TrainError:
            raise
        except Exception as exc:
            raise self._fail(f"the rollout of {len(requests)} requests", exc) from None
        self._forwards += int(after.get("forwards", 0) - before.get("forwards", 0))
        self._rows += int(after.get("rows", 0) - before.get("rows", 0))
        if self._shift:  # back to the run's own version numbers
            trajs = [dataclasses.replace(t, version=t.version - self._shift) for t in trajs]
        return trajs

    def update_weights(self, tensors: Any, version: int) -> None:
        if hasattr(tensors, "whole"):  # an FSDP learner's pieces: put them together here
            tensors = tensors.whole()
        kw: dict[str, Any] = {}
        if self.lora_config is not None:
            kw["lora_config"] = self.lora_config  # the server adds the adapter first
        if self._shift is None:  # past what the server holds: its versions only go up
            self._shift = max(0, self._served_version() + 1 - version)
        try:
            self.target.update_weights(tensors, version + self._shift, **kw)
        except Exception as exc:
            raise self._fail(f"the weight push of version {version}", exc) from None
        self.lora_config = None

    def stats(self) -> dict[str, Any]:
        return {"forwards": self._forwards, "rows": self._rows}

    @property
    def version(self) -> int:
        return self._served_version() - (self._shift or 0)

    def close(self) -> None:
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):
                close()
        self.closers.clear()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(recipe: Recipe, model_path: Path, port: int) -> list[str]:
    """`diffusion-rollout serve` loading the model as the trainer loads it (`model.device`,
    `model.dtype`, `model.options`), so the rollout samples with the learner's numbers."""
    cmd = [
        sys.executable,
        "-m",
        "diffusion_rollout.cli",
        "serve",
        "--model",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        str(recipe.rollout.max_num_seqs),
        "--device",
        recipe.model.device,
        "--dtype",
        recipe.model.dtype,
        "--log-level",
        "warning",
    ]
    if recipe.model.options:
        cmd += ["--model-options", json.dumps(dict(recipe.model.options))]
    return cmd


def start_server(recipe: Recipe, model_path: Path) -> tuple[str, subprocess.Popen]:
    """`diffusion-rollout serve` (`server_command`) on a free loopback port; returns
    (url, process) once `/health` answers. Its log goes to a temp file, named on failure."""
    port = _free_port()
    cmd = server_command(recipe, model_path, port)
    fd, log_name = tempfile.mkstemp(prefix="omni-rollout-server-", suffix=".log")
    with os.fdopen(fd, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    from diffusion_rollout import RolloutClient

    try:
        RolloutClient(url).wait_ready(timeout_s=600)
    except TimeoutError:
        proc.kill()
        raise TrainError(
            f"rollout.url: the rollout server started here did not answer on {url} within "
            f"600 s (log: {log_name})"
        ) from None
    if proc.poll() is not None:
        raise TrainError(f"rollout.url: the rollout server exited at start (log: {log_name})")
    return url, proc


def make_remote_rollout(
    recipe: Recipe, model_path: Path, lora_config: dict[str, Any] | None
) -> RemoteRollout:
    """The port of `rollout.backend` (http or vllm-omni) for one run."""
    r = recipe.rollout
    if r.backend == "http":
        from diffusion_rollout import RolloutClient

        proc = None
        url = r.url
        if url is None:
            url, proc = start_server(recipe, model_path)
        client = RolloutClient(
            url, token=os.environ.get(TOKEN_ENV), concurrency=max(64, r.max_num_seqs)
        )
        port = RemoteRollout(client, url, lora_config)
        if proc is not None:

            def stop(p: subprocess.Popen = proc) -> None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()

            port.closers.append(stop)
        else:
            try:
                client.wait_ready(timeout_s=60)
            except TimeoutError as exc:
                raise TrainError(f"rollout.url: {exc}") from None
        return port
    try:
        from diffusion_rollout import VllmOmniEngine
        from diffusion_rollout.lora import LoraSpec
    except ImportError as exc:
        raise TrainError(
            f"rollout.backend: 'vllm-omni' needs vllm-omni: pip install "
            f"'diffusion-rollout[vllm-omni]' ({exc})"
        ) from None
    spec = None if lora_config is None else LoraSpec.from_dict(lora_config).to_dict()
    try:
        # the denoiser in vllm-omni's worker loads as the trainer's does (`vllm_worker`:
        # factory(model, dtype=<engine dtype>, **denoiser_options))
        engine = VllmOmniEngine(
            str(model_path),
            lora_config=spec,
            max_num_seqs=r.max_num_seqs,
            dtype=recipe.model.dtype,
            denoiser_options=dict(recipe.model.options),
        )
    except Exception as exc:  # no GPU, no vLLM: say so, by key
        raise TrainError(f"rollout.backend: vllm-omni could not start: {exc}") from None
    port = RemoteRollout(engine, "vllm-omni", None)
    port.closers.append(engine.close)
    return port
