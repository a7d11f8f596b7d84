"""`omni-train report RUN`: one self-contained HTML page with the curves and sample grids;
`run_summary`: the lines `omni-train RECIPE` prints when a run ends."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from .checkpoint import latest_checkpoint
from .errors import TrainError
from .logger import read_metrics
from .plots import plot_reward_curve, save_figure
from .recipe import load_recipe

#: curves drawn besides the reward (each when present in metrics.jsonl)
CURVES = (
    "val/reward_mean",
    "reward/std",
    "loss",
    "actor/policy_loss",
    "actor/grad_norm",
    "actor/approx_kl",
    "actor/clipfrac",
    "policy/kl_to_ref",
    "samples/diversity",
    "timing/step_s",
)


def _first_to_last(rows: list[dict], key: str, label: str) -> str | None:
    """ "label: X (step N) -> Y (step M)" over the rows that have `key` (the step-0 baseline
    row has validation only; training rows may have no validation), or None."""
    have = [r for r in rows if isinstance(r.get(key), (int, float))]
    if not have:
        return None
    a, b = have[0], have[-1]
    return f"{label}: {a[key]:.4f} (step {a.get('step')}) -> {b[key]:.4f} (step {b.get('step')})"


def run_summary(run: str | Path) -> list[str]:
    """Where a finished run is, its reward (and validation) from first to last, its newest
    checkpoint, and the commands that read the run next."""
    run = Path(run)
    if not (run / "recipe.yaml").is_file():  # trainer.backend verl: verl's own outputs
        return [f"finished: the outputs are in {run}"]
    rows = read_metrics(run / "metrics.jsonl")
    recipe = load_recipe(run / "recipe.yaml")
    trained = [r for r in rows if "reward/mean" in r]
    lines = [f"finished: {len(trained)} steps in {run}"]
    for key, label in (("reward/mean", "reward mean"), ("val/reward_mean", "validation reward")):
        line = _first_to_last(rows, key, label)
        if line is not None:
            lines.append(f"  {line}")
    ck = latest_checkpoint(run / "checkpoint")
    if ck is not None:
        lora = ck / "lora" / "pytorch_lora_weights.safetensors"
        lines.append(f"  newest checkpoint: {ck}")
        if lora.is_file():
            lines.append(f"  its LoRA for diffusers (load_lora_weights): {lora}")
    lines.append(f"  next: omni-train report {run}  (one HTML page: curves, sample grids)")
    if not recipe.is_omni() and recipe.data.val_file is not None and ck is not None:
        lines.append(f"        omni-train eval {run} --prompts {recipe.data.val_file}")
    if recipe.lora.enabled and ck is not None:
        lines.append(f"        omni-train export {run} --format diffusers|peft|merged")
    return lines


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(path.name)}">'


def _curve_png(rows: list[dict], key: str, path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(4.2, 2.6), dpi=100)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", ms=3)
    ax.set_title(key, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def write_report(run: str | Path) -> Path:
    """Write `<run>/report.html` (images inlined, so the file can be sent alone)."""
    run = Path(run)
    rows = read_metrics(run / "metrics.jsonl")
    if not rows:
        raise TrainError(f"report: {run} has no metrics.jsonl rows (is it a run folder?)")
    tmp = run / ".report"
    tmp.mkdir(exist_ok=True)
    curve = plot_reward_curve(rows, tmp / "reward.png", title=run.name)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(run.name)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}img{margin:4px;border:1px solid #ddd}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;"
        "font-size:12px}</style></head><body>",
        f"<h1>{html.escape(run.name)}</h1>",
    ]
    last = rows[-1]
    trained = [r for r in rows if "reward/mean" in r]
    parts.append(f"<p>{len(trained)} training steps</p>")
    for key, label in (("reward/mean", "reward mean"), ("val/reward_mean", "validation reward")):
        line = _first_to_last(rows, key, label)
        if line is not None:
            parts.append(f"<p>{html.escape(line)}</p>")
    parts.append("<h2>Curves</h2>" + _img(curve))
    for i, key in enumerate(CURVES):
        png = _curve_png(rows, key, tmp / f"curve{i}.png")
        if png is not None:
            parts.append(_img(png))
    samples = sorted((run / "samples").glob("*.png")) if (run / "samples").is_dir() else []
    if samples:
        parts.append("<h2>Samples</h2>")
        for p in samples:
            parts.append(f"<h3>{html.escape(p.stem)}</h3>{_img(p)}")
    parts.append("<h2>Last step</h2><table>")
    for k, v in last.items():
        parts.append(f"<tr><td>{html.escape(k)}</td><td>{html.escape(json.dumps(v))}</td></tr>")
    parts.append("</table>")
    recipe = run / "recipe.yaml"
    if recipe.is_file():
        parts.append(f"<h2>Recipe</h2><pre>{html.escape(recipe.read_text())}</pre>")
    parts.append("</body></html>")
    out = run / "report.html"
    out.write_text("\n".join(parts))
    for p in tmp.iterdir():
        p.unlink()
    tmp.rmdir()
    return out
