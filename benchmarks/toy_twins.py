"""Does each algorithm learn? Its toy twin's held-out gain on the shapes world, with its error.

For each recipe (default: `recipes/quickstart.yaml`, MixGRPO, and every `recipes/toy/*.yaml`,
one per text-to-image algorithm), on the shapes world's toy SD3 and the quickstart's task:

1. train it with the command a user types (`omni-train RECIPE trainer.seed=S ...`), no
   validation on the way (it only costs time here), timing the run;
2. score its last LoRA on the held-out colour pairs with `omni-train eval ... --n N --seed 7`
   (deterministic ODE samples; N per prompt, 4 prompts);
3. print the held-out accuracy against the base model's (the same eval without a LoRA), the
   gain, the standard error of the gain, sqrt(se_base^2 + se_after^2), and whether the gain
   exceeds twice that error.

Every command runs in its own process, one after another (two torch processes on two cores
slow each other down several times). Each training run takes 3.5-7 minutes on 2 CPU cores;
all seven about 45.

    python benchmarks/toy_twins.py --seed 1
    python benchmarks/toy_twins.py --seed 1 --recipes recipes/toy/flow_grpo.yaml --n 64
    python benchmarks/toy_twins.py --set trainer.steps=60   # longer runs
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
HELD_OUT = REPO / "recipes" / "data" / "shapes" / "colors_heldout.txt"


def omni_train(args: list[str], log: Path) -> float:
    """Run `omni-train ARGS` in its own process (output to `log`); the wall seconds."""
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "omni_train.cli", *args], cwd=REPO, stdout=f, stderr=f
        )
    if proc.returncode:
        raise SystemExit(f"omni-train {' '.join(args)} failed (rc {proc.returncode}); see {log}")
    return time.perf_counter() - start


def held_out(target: Path, out: Path, n: int, extra: list[str]) -> dict:
    """`omni-train eval TARGET` on the held-out colour pairs: its JSON summary."""
    omni_train(
        ["eval", str(target), "--prompts", str(HELD_OUT), "--reward", "shapes",
         "--n", str(n), "--seed", "7", "--out", str(out), "--no-progress", *extra],
        out.with_suffix(".log"),
    )  # fmt: skip
    return json.loads((out / "eval.json").read_text())


def _two(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"  # diversity is None with one sample a prompt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--recipes",
        nargs="+",
        type=Path,
        default=[REPO / "recipes" / "quickstart.yaml", *sorted(REPO.glob("recipes/toy/*.yaml"))],
    )
    p.add_argument("--seed", type=int, default=1, help="trainer.seed of every run")
    p.add_argument("--n", type=int, default=128, help="eval samples per held-out prompt")
    p.add_argument("--out", type=Path, default=Path("runs/toy_twins"))
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run"
    )
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    rows = []
    base = None
    for recipe in args.recipes:
        name = recipe.stem
        run = (args.out / f"{name}_seed{args.seed}").resolve()
        seconds = omni_train(
            [str(recipe), f"trainer.output_dir={run}", f"trainer.seed={args.seed}",
             "trainer.val_every=0", "trainer.progress=false", *args.set],
            args.out / f"{name}_seed{args.seed}.log",
        )  # fmt: skip
        if base is None:  # the base model at the same sampler settings as the runs' eval
            base = held_out(
                REPO / "recipes" / "models" / "shapes_sd3",
                args.out / "base",
                args.n,
                ["--recipe", str(run / "recipe.yaml")],
            )
            print(f"base model: held out {base['mean']:.3f} +- {base['stderr']:.3f}", flush=True)
        after = held_out(run, args.out / f"{name}_seed{args.seed}_eval", args.n, [])
        gain = after["mean"] - base["mean"]
        se = math.hypot(base["stderr"], after["stderr"])
        algorithm = yaml.safe_load((run / "recipe.yaml").read_text())["algorithm"]["name"]
        rows.append((name, algorithm, seconds, after["mean"], after["stderr"], gain, se,
                     after["diversity"]))  # fmt: skip
        print(
            f"{name} ({algorithm}): {seconds:.0f} s, held out {after['mean']:.3f}"
            f" +- {after['stderr']:.3f}, gain {gain:+.3f} ({gain / se:+.1f} se),"
            f" diversity {_two(after['diversity'])}",
            flush=True,
        )

    print(f"\nseed {args.seed}, {args.n} samples a held-out prompt, base {base['mean']:.3f}")
    print("| recipe | algorithm | train s | held out | gain | gain / se | > 2 se | diversity |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, algorithm, s, mean, err, gain, se, div in rows:
        print(
            f"| {name} | {algorithm} | {s:.0f} | {mean:.3f} +- {err:.3f} | {gain:+.3f} | {gain / se:+.1f} | "
            f"{'yes' if gain > 2 * se else 'no'} | {_two(div)} |"
        )


if __name__ == "__main__":
    main()
