"""Fit the latent reward model a recipe trains against, from the policy's own rollouts.

`reward.name: latent` scores clean latents with a small scorer (`omni_rewards.latent`), so
training needs no VAE decode. The scorer must exist first. With `reward.distill` set and
`reward.options.path` missing, `ensure_latent_scorer` makes it: it rolls out
`distill.samples` samples of the recipe's own model and prompts (seeds from `distill.seed`,
so the same recipe makes the same scorer), decodes them once, scores them with the teacher
(any image reward) and fits the scorer with `omni_rewards.latent.distill_latent` (MSE plus a
pairwise ranking loss). The held-out Spearman correlation against the teacher goes to the
console and to `report.json` next to the weights.

The folder is a cache: `report.json` records what the scorer was fitted for (`fitted_for`:
a fingerprint of the model's files, a digest of the prompts, the sampling parameters and
`reward.distill`). A later run with the same settings reuses it, whatever its `trainer.seed`
and wherever its copy of the model lies; one with other settings stops with an error naming
the keys that differ, rather than train against a scorer of another recipe or overwrite it.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import TrainError
from .recipe import Recipe
from .seeds import DOMAIN_DISTILL, derive_seed

__all__ = ["ensure_latent_scorer", "fitted_for", "model_fingerprint", "rollout_in_chunks"]


def model_fingerprint(path: str | Path) -> str:
    """A sha256 over a model folder's files (not its Markdown cards or hidden files): each
    one's relative name and size, and its bytes (for a file over 4 MiB, 16 evenly spaced
    samples of 64 KiB: two checkpoints of one architecture have the same names and sizes, not
    the same weights). The same model copied to another folder keeps its fingerprint."""
    root = Path(path).expanduser()
    h = hashlib.sha256()
    if not root.is_dir():
        h.update(str(path).encode())
        return h.hexdigest()
    whole, sample, samples = 4 << 20, 64 << 10, 16
    files = [q for q in root.rglob("*") if q.is_file() and q.suffix != ".md"]
    files = [
        q for q in files if not any(part.startswith(".") for part in q.relative_to(root).parts)
    ]
    for f in sorted(files):
        size = f.stat().st_size
        h.update(f"{f.relative_to(root).as_posix()}\0{size}\0".encode())
        with f.open("rb") as fh:
            if size <= whole:
                h.update(fh.read())
                continue
            for i in range(samples):
                fh.seek((size - sample) * i // (samples - 1))
                h.update(fh.read(sample))
    return h.hexdigest()


def fitted_for(recipe: Recipe, params: Any, prompts: list[str]) -> dict[str, Any]:
    """What decides the scorer `reward.distill` fits (a JSON object; module docstring)."""
    d = recipe.reward.distill
    assert d is not None
    return {
        "model_sha256": model_fingerprint(recipe.model.path),
        "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
        "sampling": json.loads(json.dumps(params.to_dict())),
        "reward.distill": d.model_dump(mode="json"),
    }


def rollout_in_chunks(
    port: Any, requests: list[Any], chunk: int, *, progress: bool, desc: str
) -> list[Any]:
    """``port.generate_many`` over ``requests`` in chunks of ``chunk``, with a progress bar
    (any rollout port: the local engine, Ray workers, a server). A chunk that is a multiple
    of the engine's wave (`rollout.max_num_seqs`) keeps the waves one call would run."""
    from tqdm.auto import tqdm

    out: list[Any] = []
    with tqdm(total=len(requests), desc=desc, unit="sample", disable=not progress) as bar:
        for i in range(0, len(requests), chunk):
            out.extend(port.generate_many(requests[i : i + chunk]))
            bar.update(min(chunk, len(requests) - i))
    return out


def _differences(want: dict[str, Any], have: dict[str, Any], prefix: str = "") -> list[str]:
    keys = sorted(set(want) | set(have))
    out = []
    for k in keys:
        a, b = want.get(k), have.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: this run {a!r}, the scorer {b!r}")
    return out


def ensure_latent_scorer(recipe: Recipe, engine: Any, params: Any, prompts: list[str]) -> None:
    """Distil the scorer at `reward.options.path` if the recipe asks and it is missing; reuse
    it if it was fitted for these settings; else a TrainError (module docstring)."""
    from diffusion_rollout import RolloutRequest
    from omni_rewards import MissingDependencyError, load_reward
    from omni_rewards.latent import distill_latent, save_scorer

    rw = recipe.reward
    if rw.name != "latent" or rw.distill is None:
        return
    path = rw.options.get("path")
    if not isinstance(path, str):
        raise TrainError("reward.options.path: the latent scorer's folder (a string) is required")
    out = Path(path).expanduser()
    want = fitted_for(recipe, params, prompts)
    if (out / "config.json").is_file():
        report_file = out / "report.json"
        try:
            report = json.loads(report_file.read_text()) if report_file.is_file() else {}
        except (OSError, ValueError) as exc:
            raise TrainError(f"reward.options.path: {report_file} cannot be read: {exc}") from None
        have = report.get("fitted_for") if isinstance(report, dict) else None
        if have is None:
            print(f"reward.distill: reusing the scorer in {out} (it records no fitting settings)")
            return
        diff = _differences(want, have)
        if diff:
            raise TrainError(
                f"reward.options.path: {out} holds a latent scorer fitted for other settings "
                f"({'; '.join(diff)}); point reward.options.path at another folder to fit one "
                "for this run, or delete that folder"
            )
        print(f"reward.distill: reusing the scorer in {out} (fitted for these settings)")
        return
    d = rw.distill
    try:
        teacher = load_reward(d.teacher, **d.teacher_options)
    except MissingDependencyError as exc:
        raise TrainError(f"reward.distill.teacher: {exc}") from None
    except KeyError as exc:
        raise TrainError(f"reward.distill.teacher: {exc.args[0]}") from None
    reqs = [
        RolloutRequest(
            prompt=prompts[i % len(prompts)],
            seed=derive_seed(d.seed, 0, i, DOMAIN_DISTILL),
            params=params,
            request_id=f"distill-{i}",
        )
        for i in range(d.samples)
    ]
    print(f"reward.distill: {d.samples} rollouts for the latent scorer (teacher {d.teacher})")
    wave = recipe.rollout.max_num_seqs  # about 20 bar updates, each a whole number of waves
    chunk = wave * max(1, math.ceil(d.samples / (20 * wave)))
    progress = recipe.trainer.progress
    trajs = rollout_in_chunks(engine, reqs, chunk, progress=progress, desc="distill rollouts")
    latents = torch.stack([t.final_latent for t in trajs]).float().numpy()
    images = torch.stack([t.media for t in trajs]).numpy()
    model, cfg, report = distill_latent(
        teacher,
        latents,
        images,
        prompts=[r.prompt for r in reqs],
        steps=d.steps,
        batch_size=d.batch_size,
        seed=d.seed,
        teacher_name=d.teacher,
        progress=progress,
    )
    report["fitted_for"] = want
    save_scorer(model, cfg, out, report)
    print(
        f"reward.distill: scorer saved to {out}; held-out Spearman vs {d.teacher} "
        f"{report['spearman']:.3f}, pairwise accuracy {report['pairwise_accuracy']:.3f} "
        f"({report['heldout_pairs']} pairs)"
    )
    if not np.isfinite(report["spearman"]):
        raise TrainError(
            f"reward.distill: the teacher {d.teacher!r} gave constant scores on the rollouts; "
            "nothing to distil"
        )
