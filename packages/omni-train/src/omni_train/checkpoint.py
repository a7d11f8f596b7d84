"""Checkpoints without pickle: tensors in safetensors, everything else in JSON.

Layout of `<run>/checkpoint/`:

    latest                       text file naming the newest complete checkpoint
    step_0010/
      trainable.safetensors      the trainable parameters by module name (exact resume)
      lora/                      the LoRA export for users (adapter format), when available
      optimizer.safetensors      optimizer state tensors, keys `state.<param index>.<name>`
      optimizer.json             optimizer param groups and non-tensor state
      rng.safetensors / rng.json torch, numpy and python RNG states
      manifest.json              SHA-256 and size of every other file
      state.json                 step, weights version, the step's metrics row; written last

A checkpoint is written into a temporary folder and renamed into place, and `latest` is
replaced atomically afterwards, so a crash mid-save never leaves a broken latest checkpoint;
temp folders a killed save left are removed at the next start (`remove_stale_saves`).
Loading verifies every file against the manifest: a truncated, emptied, flipped or missing
file is a `CheckpointError` naming the file, and `newest_good_checkpoint` falls back to the
newest checkpoint that verifies.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .errors import TrainError


def optimizer_state_to_safe(opt_state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
    """Split `optimizer.state_dict()` into safetensors-able tensors and JSON metadata."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"param_groups": opt_state["param_groups"], "state": {}}
    for idx, st in opt_state["state"].items():
        entry: dict[str, Any] = {"tensors": [], "values": {}}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"state.{idx}.{k}"] = v.detach().cpu().clone().contiguous()
                entry["tensors"].append(k)
            else:
                entry["values"][k] = v
        meta["state"][str(idx)] = entry
    return tensors, meta


def optimizer_state_from_safe(tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, Any]:
    """Inverse of `optimizer_state_to_safe`."""
    state: dict[int, dict[str, Any]] = {}
    for idx, entry in meta["state"].items():
        st: dict[str, Any] = dict(entry["values"])
        for k in entry["tensors"]:
            st[k] = tensors[f"state.{idx}.{k}"]
        state[int(idx)] = st
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """torch (CPU and CUDA), numpy and python RNG states."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    np_state = np.random.get_state()
    tensors["numpy.keys"] = torch.from_numpy(np.asarray(np_state[1], dtype=np.int64))
    py_version, py_state, py_gauss = random.getstate()
    meta = {
        "numpy": {
            "name": np_state[0],
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }
    return tensors, meta


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = sorted(k for k in tensors if k.startswith("cuda."))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    n = meta["numpy"]
    np.random.set_state(
        (
            n["name"],
            tensors["numpy.keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    p = meta["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


class CheckpointError(TrainError):
    """A checkpoint that does not verify; the message names the folder and the file."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    trainable: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    rng_tensors: dict[str, torch.Tensor]
    rng_meta: dict[str, Any]
    state: dict[str, Any] = field(default_factory=dict)
    # weights version -> the rollout weights of that version (an async run's older versions)
    rollout_versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def restore_rng(self) -> None:
        restore_rng(self.rng_tensors, self.rng_meta)


def _write_json(path: Path, obj: Any) -> None:
    with path.open("w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    ckpt_root: str | Path,
    step: int,
    trainable: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
    state: dict[str, Any] | None = None,
    lora_files: dict[str, bytes] | None = None,
    lora_tensors: dict[str, torch.Tensor] | None = None,
    lora_config: dict[str, Any] | None = None,
    keep: int = 2,
    rollout_versions: dict[int, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write checkpoint `step_XXXX` under `ckpt_root` atomically and point `latest` at it.

    `step` is the number of completed training steps; `optimizer_state` an optimizer's
    ``state_dict()`` (None: not saved). `lora_tensors` / `lora_config` (or raw `lora_files`)
    are the user-facing LoRA export, written to `lora/`. `rollout_versions` (weights version ->
    rollout weights) go to `rollout/version_N.safetensors`: the older versions an async run's
    rollouts in flight were launched on, so that a resume launches them on the same ones.
    """
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:04d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in trainable.items()},
        str(tmp / "trainable.safetensors"),
    )
    if lora_tensors is not None or lora_files:
        (tmp / "lora").mkdir()
        if lora_tensors is not None:
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in lora_tensors.items()},
                str(tmp / "lora" / "adapter_model.safetensors"),
            )
        if lora_config is not None:
            _write_json(tmp / "lora" / "adapter_config.json", lora_config)
        for fname, data in (lora_files or {}).items():
            (tmp / "lora" / fname).write_bytes(data)
    if rollout_versions:
        (tmp / "rollout").mkdir()
        for version, tensors in rollout_versions.items():
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                str(tmp / "rollout" / f"version_{int(version)}.safetensors"),
            )
    if optimizer_state is not None:
        opt_tensors, opt_meta = optimizer_state_to_safe(optimizer_state)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        _write_json(tmp / "optimizer.json", opt_meta)
    rng_tensors, rng_meta = capture_rng()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    _write_json(tmp / "rng.json", rng_meta)
    _write_json(tmp / "manifest.json", _manifest(tmp))
    _write_json(tmp / "state.json", {"step": step, **(state or {})})
    _fsync_dir(tmp)

    final = root / name
    if final.exists():  # re-saving a step (e.g. after resume): move the old one out first
        trash = root / f".old-{name}-{os.getpid()}"
        final.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    tmp.rename(final)
    latest_tmp = root / f".latest-{os.getpid()}"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)

    done = sorted(p for p in root.glob("step_*") if (p / "state.json").is_file())
    for old in done[:-keep]:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, Any]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {
        "files": {
            str(p.relative_to(folder)): {"sha256": _sha256(p), "bytes": p.stat().st_size}
            for p in files
            if p.name not in ("manifest.json", "state.json")
        }
    }


def verify_checkpoint(path: str | Path) -> None:
    """Check every file of a checkpoint against its manifest (and that the JSON parses);
    `CheckpointError` naming the first bad file."""
    p = Path(path)

    def bad(name: str, why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {p}: {name} {why}")

    for name in ("state.json", "manifest.json"):
        if not (p / name).is_file():
            raise bad(name, "is missing")
    try:
        manifest = json.loads((p / "manifest.json").read_text())
        state = json.loads((p / "state.json").read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad("state.json / manifest.json", f"is not valid JSON ({exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise bad("state.json", f"has no integer 'step' ({str(state)[:80]})")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise bad("manifest.json", "has no 'files' table")
    for name, want in files.items():
        f = p / name
        if not f.is_file():
            raise bad(name, "is missing")
        if f.stat().st_size != want.get("bytes") or _sha256(f) != want.get("sha256"):
            raise bad(name, "does not match its hash in manifest.json (truncated or changed)")


def remove_stale_saves(ckpt_root: str | Path) -> list[str]:
    """Remove what killed saves left under `ckpt_root` (temp, swap and latest-pointer files);
    returns their names."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    gone = []
    for p in sorted(root.iterdir()):
        if p.name.startswith((".tmp-step_", ".old-step_", ".latest-")):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            gone.append(p.name)
    return gone


def checkpoints(ckpt_root: str | Path) -> list[Path]:
    """Every complete checkpoint folder (with a state.json), oldest first."""
    root = Path(ckpt_root)
    done = [p for p in root.glob("step_*") if (p / "state.json").is_file()]
    return sorted(done, key=lambda p: p.name)


def checkpoint_of_step(run: str | Path, step: int) -> Path:
    """`run`'s checkpoint of step `step`, verified; `CheckpointError` listing the steps the
    run has when there is none (the caller names its own option in front)."""
    root = Path(run) / "checkpoint"
    ck = root / f"step_{step:04d}"
    if not (ck / "state.json").is_file():
        have = sorted(q.name for q in root.glob("step_*"))
        raise CheckpointError(f"{ck} is not a checkpoint; have: {have}")
    verify_checkpoint(ck)
    return ck


def newest_good_checkpoint(ckpt_root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and why each newer one was passed over."""
    skipped = []
    for cand in reversed(checkpoints(ckpt_root)):
        try:
            verify_checkpoint(cand)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        return cand, skipped
    return None, skipped


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest complete checkpoint folder (not verified), or None."""
    done = checkpoints(ckpt_root)
    return done[-1] if done else None


def load_checkpoint_state(path: str | Path) -> dict[str, Any]:
    """A checkpoint folder's `state.json` (step, weights version, backend)."""
    return json.loads((Path(path) / "state.json").read_text())


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load a checkpoint folder (`.../checkpoint/step_XXXX`) or the latest under a root."""
    p = Path(path)
    if not (p / "state.json").is_file():
        found = latest_checkpoint(p)
        if found is None:
            raise TrainError(f"no complete checkpoint under {p}")
        p = found
    if (p / "manifest.json").is_file():
        verify_checkpoint(p)
    try:
        state = json.loads((p / "state.json").read_text())
        trainable = load_file(str(p / "trainable.safetensors"))
        optimizer = None
        if (p / "optimizer.json").is_file():
            optimizer = optimizer_state_from_safe(
                load_file(str(p / "optimizer.safetensors")),
                json.loads((p / "optimizer.json").read_text()),
            )
        rng_tensors = load_file(str(p / "rng.safetensors"))
        rng_meta = json.loads((p / "rng.json").read_text())
        step = int(state["step"])
        rollout_versions = {
            int(f.stem.removeprefix("version_")): load_file(str(f))
            for f in sorted((p / "rollout").glob("version_*.safetensors"))
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a checkpoint of an older
        # layout without a manifest that is broken anyway: say which, never a traceback
        raise CheckpointError(f"checkpoint {p} cannot be read: {exc}") from None
    return Checkpoint(p, step, trainable, optimizer, rng_tensors, rng_meta, state, rollout_versions)
