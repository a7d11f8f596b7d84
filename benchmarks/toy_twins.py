"""Does each algorithm learn? Its toy twin's held-out gain on the shapes world, with its error.

For each recipe (default: `recipes/quickstart.yaml`, MixGRPO, and every `recipes/toy/*.yaml`,
one per text-to-image algorithm), on the shapes world's toy SD3 and the quickstart's task:

1. train it with the command a user types (`omni-train RECIPE trainer.seed=S ...`), no
   validation on the way (it only costs time here), timing the run;
2. score its last LoRA on each prompt file of `--prompts` (default: the held-out colour pairs)
   with `omni-train eval ... --n N --seed 7` (deterministic ODE samples, N per prompt);
3. print, per prompt file, a table like GenEval's (Ghosh et al. 2023): the base model (the
   same eval without a LoRA) and each run, their accuracy, the gain, the standard error of the
   gain, sqrt(se_base^2 + se_after^2), whether the gain exceeds twice that error, and the
   accuracy per task type of the file's captions.

Every command runs in its own process, one after another (two torch processes on two cores
slow each other down several times). Each training run takes 3.5-7 minutes on 2 CPU cores;
all seven about 45.

    python benchmarks/toy_twins.py --seed 1
    python benchmarks/toy_twins.py --seed 1 --recipes recipes/toy/flow_grpo.yaml --n 64
    python benchmarks/toy_twins.py --set trainer.steps=60   # longer runs
    python benchmarks/toy_twins.py --recipes recipes/quickstart.yaml --n 4 \
        --prompts recipes/data/shapes/heldout.txt recipes/data/shapes/handwritten.txt
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
#: GenEval's task columns, in its table's order (`omni_rewards.shapes.TASKS` names them)
TASK_COLUMNS = {
    "single_object": "single object",
    "two_object": "two object",
    "counting": "counting",
    "colors": "colors",
    "position": "position",
    "color_attr": "colour attribution",
}


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


def evaluate(target: Path, prompts: Path, out: Path, n: int, extra: list[str]) -> dict:
    """`omni-train eval TARGET --prompts PROMPTS`: its JSON summary."""
    omni_train(
        ["eval", str(target), "--prompts", str(prompts), "--reward", "shapes",
         "--n", str(n), "--seed", "7", "--out", str(out), "--no-progress", *extra],
        out.with_suffix(".log"),
    )  # fmt: skip
    return json.loads((out / "eval.json").read_text())


def _two(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"  # diversity is None with one sample a prompt


def gain_and_se(base: dict, after: dict) -> tuple[float, float]:
    """The gain over the base and its standard error, sqrt(se_base^2 + se_after^2)."""
    return after["mean"] - base["mean"], math.hypot(base["stderr"], after["stderr"])


def print_table(stem: str, n: int, seed: int, base: dict, rows: list[tuple]) -> None:
    """One prompt file's table: the base model's row, then each run's."""
    tasks = [t for t in TASK_COLUMNS if t in base["per_task"]]
    print(f"\n{stem}: seed {seed}, {n} samples a prompt, base {base['mean']:.3f}")
    print("| recipe | algorithm | train s | accuracy | gain | gain / se | > 2 se | diversity | "
          + "".join(f"{TASK_COLUMNS[t]} | " for t in tasks))  # fmt: skip
    print("| --- " * (8 + len(tasks)) + "|")

    def per_task(summary: dict) -> str:
        return "".join(f"{summary['per_task'][t]['mean']:.3f} | " for t in tasks)

    print(
        f"| base model | - | - | {base['mean']:.3f} +- {base['stderr']:.3f} | | | | "
        f"{_two(base['diversity'])} | {per_task(base)}"
    )
    for name, algorithm, s, after in rows:
        gain, se = gain_and_se(base, after)
        print(
            f"| {name} | {algorithm} | {s:.0f} | {after['mean']:.3f} +- {after['stderr']:.3f} | "
            f"{gain:+.3f} | {gain / se:+.1f} | {'yes' if gain > 2 * se else 'no'} | "
            f"{_two(after['diversity'])} | {per_task(after)}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--recipes",
        nargs="+",
        type=Path,
        default=[REPO / "recipes" / "quickstart.yaml", *sorted(REPO.glob("recipes/toy/*.yaml"))],
    )
    p.add_argument("--seed", type=int, default=1, help="trainer.seed of every run")
    p.add_argument("--n", type=int, default=128, help="eval samples per prompt")
    p.add_argument("--out", type=Path, default=Path("runs/toy_twins"))
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run"
    )
    p.add_argument(
        "--prompts",
        nargs="+",
        type=Path,
        default=[HELD_OUT],
        help="prompt files to score each run on (a table each)",
    )
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    rows: dict[str, list[tuple]] = {prompts.stem: [] for prompts in args.prompts}
    bases: dict[str, dict] = {}
    for recipe in args.recipes:
        name = recipe.stem
        run = (args.out / f"{name}_seed{args.seed}").resolve()
        seconds = omni_train(
            [str(recipe), f"trainer.output_dir={run}", f"trainer.seed={args.seed}",
             "trainer.val_every=0", "trainer.progress=false", *args.set],
            args.out / f"{name}_seed{args.seed}.log",
        )  # fmt: skip
        algorithm = yaml.safe_load((run / "recipe.yaml").read_text())["algorithm"]["name"]
        for prompts in args.prompts:
            stem = prompts.stem
            if stem not in bases:  # the base model at the same sampler settings as the runs'
                bases[stem] = evaluate(
                    REPO / "recipes" / "models" / "shapes_sd3",
                    prompts,
                    args.out / f"base_{stem}",
                    args.n,
                    ["--recipe", str(run / "recipe.yaml")],
                )
                print(f"base model on {stem}: {bases[stem]['mean']:.3f}", flush=True)
            base = bases[stem]
            after = evaluate(run, prompts, args.out / f"{name}_seed{args.seed}_{stem}", args.n, [])
            rows[stem].append((name, algorithm, seconds, after))
            gain, se = gain_and_se(base, after)
            print(
                f"{name} ({algorithm}): {seconds:.0f} s, {stem} {after['mean']:.3f}"
                f" +- {after['stderr']:.3f}, gain {gain:+.3f} ({gain / se:+.1f} se),"
                f" diversity {_two(after['diversity'])}",
                flush=True,
            )

    for stem, stem_rows in rows.items():
        print_table(stem, args.n, args.seed, bases[stem], stem_rows)


if __name__ == "__main__":
    main()
