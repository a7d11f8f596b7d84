"""`omni-train`: run, validate or resume a recipe.

    omni-train RECIPE [key=value ...]        train (overrides are dotted YAML scalars)
    omni-train validate RECIPE [key=value ...]   check a recipe without running it
    omni-train validate --memory RECIPE          ... and estimate its per-GPU memory
    omni-train resume RUN [--checkpoint N] [key=value ...]   continue RUN (latest checkpoint)
    omni-train export RUN --format diffusers|peft|merged [--out DIR]   the trained weights
    omni-train eval RUN_OR_MODEL --prompts FILE [--reward NAME] [--n K] [--seed S] [--out DIR]
                                             sample (ODE) and score; one JSON object on stdout
    omni-train report RUN                    write RUN/report.html (curves, sample grids)
    omni-train prepare NAME [--out DIR]      write a dataset (ocr, pickscore, video, edit, mmk12)
    omni-train recipes list|copy NAME [--to DIR]   the recipes that ship with omni-train
    omni-train pretrain CONFIG [key=value ...]   train the toy SD3 from scratch (shapes world)
    omni-train pretrain CONFIG --evaluate MODEL  its held-out accuracy (shapes reward, ODE)
    omni-train --version

Bad recipes and runs that cannot start print one clear message, never a stack trace.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import TrainError
from .recipe import RecipeError
from .version import version_text

COMMANDS = ("validate", "resume", "report", "prepare", "recipes", "export", "eval", "pretrain")

USAGE = """omni-train RECIPE [key=value ...]
       omni-train validate RECIPE [key=value ...]
       omni-train validate --memory RECIPE [--published NAME] [--gpu-gib GIB]
       omni-train resume RUN [--checkpoint N] [key=value ...]
       omni-train export RUN --format diffusers|peft|merged [--out DIR] [--checkpoint N]
       omni-train eval RUN_OR_MODEL --prompts FILE [--reward NAME] [--n K] [--seed S]
                       [--out DIR] [--recipe R] [--checkpoint N] [key=value ...]
       omni-train report RUN
       omni-train prepare NAME [--out DIR]
       omni-train recipes list|copy NAME [--to DIR]
       omni-train pretrain CONFIG [--evaluate MODEL] [key=value ...]
       omni-train --version"""


def _parser(cmd: str | None) -> argparse.ArgumentParser:
    if cmd == "validate":
        p = argparse.ArgumentParser(
            prog="omni-train validate", description="Check a recipe without running it."
        )
        p.add_argument("recipe", help="path to a recipe YAML")
        p.add_argument(
            "--dry-run",
            action="store_true",
            help="also run one step of it into a temporary folder (builds the model and the "
            "reward, rolls out, scores, updates)",
        )
        p.add_argument(
            "--memory",
            action="store_true",
            help="estimate per-GPU training memory from the released model's configs (meta "
            "device, no weights)",
        )
        p.add_argument(
            "--published",
            default=None,
            help="--memory: the published model (name or repo id) when model.path's folder "
            "name does not say it",
        )
        p.add_argument(
            "--gpu-gib",
            type=float,
            default=None,
            help="--memory: GPU memory in GiB (default: report 80 and 141)",
        )
    elif cmd == "resume":
        p = argparse.ArgumentParser(
            prog="omni-train resume",
            description="Continue a run from its latest checkpoint (same data order, RNG and "
            "optimizer state).",
        )
        p.add_argument("run", help="run folder (runs/<experiment>)")
        p.add_argument(
            "--checkpoint",
            type=int,
            default=None,
            metavar="N",
            help="resume from checkpoint/step_N instead of the latest",
        )
    elif cmd == "export":
        p = argparse.ArgumentParser(
            prog="omni-train export",
            description="Write a run's trained weights for use elsewhere: `peft` (an adapter "
            "folder for peft), `diffusers` (pytorch_lora_weights.safetensors for "
            "pipe.load_lora_weights), `merged` (the whole model with the LoRA merged into its "
            "weights, loadable like the base model).",
        )
        p.add_argument("run", help="run folder (runs/<experiment>)")
        p.add_argument("--format", required=True, choices=["diffusers", "peft", "merged"])
        p.add_argument("--out", default=None, help="output folder (default RUN/export/FORMAT)")
        p.add_argument(
            "--checkpoint",
            type=int,
            default=None,
            metavar="N",
            help="checkpoint/step_N (default: the latest)",
        )
        return p
    elif cmd == "eval":
        p = argparse.ArgumentParser(
            prog="omni-train eval",
            description="Sample K images per prompt deterministically (ODE) with a run's "
            "trained policy (its newest verified checkpoint) or a base model, score them, "
            "print one JSON object (mean, per-prompt and per-task means, count) and write it "
            "with a labelled grid to --out.",
        )
        p.add_argument(
            "target",
            metavar="RUN_OR_MODEL",
            help="a run folder (recipe.yaml + checkpoint/) or a saved model folder (no LoRA)",
        )
        p.add_argument(
            "--prompts", required=True, metavar="FILE", help="prompts (.txt, .jsonl, .parquet)"
        )
        p.add_argument("--reward", default=None, metavar="NAME", help="instead of the recipe's")
        p.add_argument(
            "--n",
            type=int,
            default=None,
            metavar="K",
            help="images per prompt (default: the recipe's trainer.val_samples_per_prompt)",
        )
        p.add_argument(
            "--seed", type=int, default=None, help="seed (default: the recipe's trainer.seed)"
        )
        p.add_argument(
            "--out",
            default=None,
            metavar="DIR",
            help="where eval.json and grid.png go (default RUN/eval/<FILE stem>, or "
            "runs/eval/<model>-<FILE stem>)",
        )
        p.add_argument(
            "--recipe",
            default=None,
            metavar="R",
            help="a model folder: take rollout settings, dtype, device and reward from R",
        )
        p.add_argument(
            "--checkpoint",
            type=int,
            default=None,
            metavar="N",
            help="a run: checkpoint/step_N instead of the newest",
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    elif cmd == "prepare":
        p = argparse.ArgumentParser(
            prog="omni-train prepare",
            description="Write a dataset as JSONL: prompts (ocr, pickscore, video), or rows with "
            "generated PNGs (edit: image-editing pairs; mmk12: the shapes task in MMK12 format).",
        )
        p.add_argument("name", help="dataset: ocr, pickscore, video, edit or mmk12")
        p.add_argument("--out", default=None, help="output folder (default data/NAME)")
        p.add_argument("--seed", type=int, default=0, help="seed of the split / generated items")
        p.add_argument(
            "--size", type=int, default=None, help="edit, mmk12: image side in pixels (512, 32)"
        )
        p.add_argument(
            "--count", type=int, default=None, help="edit, mmk12: generated items (512, 256)"
        )
        return p
    elif cmd == "pretrain":
        p = argparse.ArgumentParser(
            prog="omni-train pretrain",
            description="Train a toy SD3 from scratch by flow matching on the shapes world "
            "(omni_train.pretrain); writes OUTPUT_DIR/model (loads with "
            "omni_adapters.from_pretrained), metrics.jsonl, loss_curve.png, samples.png, "
            "eval.json.",
        )
        p.add_argument(
            "recipe",
            metavar="config",
            help="pretrain YAML, or the name of a shipped one (shapes_sd3)",
        )
        p.add_argument(
            "--evaluate",
            default=None,
            metavar="MODEL",
            help="do not train: sample the config's held-out captions (sample.*) from the saved "
            "MODEL, print the shapes-reward accuracy as JSON, write OUTPUT_DIR/samples.png",
        )
    elif cmd == "report":
        p = argparse.ArgumentParser(
            prog="omni-train report", description="Write RUN/report.html: curves and samples."
        )
        p.add_argument("run", help="run folder (runs/<experiment>)")
        return p
    else:
        p = argparse.ArgumentParser(
            prog="omni-train",
            usage=USAGE,
            # keeps the --version line whole (argparse wraps version text like a paragraph)
            formatter_class=argparse.RawDescriptionHelpFormatter,
            description="RL post-training from a YAML recipe. "
            "Subcommands: validate, resume, export, eval, report, prepare, recipes, pretrain.",
        )
        p.add_argument("recipe", help="path to a recipe YAML")
        p.add_argument("--version", action="version", version=version_text())
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.steps=5"
    )
    return p


def _print_summary(run_dir: str) -> None:
    from .report import run_summary

    for line in run_summary(run_dir):
        print(line, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    cmd = args_list[0] if args_list and args_list[0] in COMMANDS else None
    if cmd == "recipes":
        from .recipes_cli import main as recipes_main

        return recipes_main(args_list[1:])
    parser = _parser(cmd)
    rest = args_list[1:] if cmd else args_list
    # eval and pretrain take key=value overrides after their options too
    # (`... --n 4 rollout.height=32`)
    intermixed = cmd in ("eval", "pretrain")
    args = parser.parse_intermixed_args(rest) if intermixed else parser.parse_args(rest)
    run_dir: str | None = None
    try:
        if cmd == "validate":
            from .recipe import load_recipe
            from .validate import validate_recipe

            recipe = load_recipe(args.recipe, args.overrides)
            for line in validate_recipe(recipe):
                print(line)
            if args.dry_run:
                from .validate import dry_run

                print(dry_run(recipe))
            if args.memory:
                from .memory_report import memory_report

                for line in memory_report(recipe, published=args.published, gpu_gib=args.gpu_gib):
                    print(line)
            print(f"ok: {args.recipe} is a valid recipe")
            return 0
        if cmd == "prepare":
            from .prepare import prepare

            try:
                paths = prepare(
                    args.name, args.out, seed=args.seed, size=args.size, count=args.count
                )
            except ValueError as exc:
                raise RecipeError(str(exc)) from None
            for split, path in paths.items():
                n = sum(1 for _ in path.open())
                print(f"wrote {path} ({n} {split} prompts)")
            return 0
        if cmd == "pretrain":
            from .pretrain import load_pretrain_config, pretrain

            cfg = load_pretrain_config(args.recipe, args.overrides)
            if args.evaluate is not None:
                import json

                from .pretrain import evaluate

                if not Path(args.evaluate).is_dir():
                    raise RecipeError(f"--evaluate: {args.evaluate} is not a model folder")
                print(json.dumps(evaluate(args.evaluate, cfg.sample, cfg.output_dir)))
                return 0
            model_dir = pretrain(cfg)
            print(f"wrote {model_dir}")
            ev = model_dir.parent / "eval.json"
            if ev.is_file():
                print(f"held-out accuracy (shapes reward, ODE): {ev.read_text().strip()}")
            return 0
        if cmd == "report":
            from .report import write_report

            print(f"wrote {write_report(args.run)}")
            return 0
        if cmd == "eval":
            import contextlib
            import json

            from .evaluate import evaluate

            with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON only
                result = evaluate(
                    args.target,
                    args.prompts,
                    reward=args.reward,
                    n=args.n,
                    seed=args.seed,
                    out=args.out,
                    recipe=args.recipe,
                    checkpoint=args.checkpoint,
                    overrides=args.overrides,
                    progress=not args.no_progress,
                )
            print(json.dumps(result))
            return 0
        if cmd == "export":
            from .export import export_run

            print(f"wrote {export_run(args.run, args.format, args.out, args.checkpoint)}")
            return 0
        if cmd == "resume":
            from .train import resume

            run_dir = args.run
            resume(args.run, args.overrides, checkpoint=args.checkpoint)
            _print_summary(run_dir)
            return 0
        from .recipe import load_recipe
        from .train import train

        recipe = load_recipe(args.recipe, args.overrides)
        run_dir = str(recipe.output_dir())
        train(recipe)
        _print_summary(run_dir)
        return 0
    except (RecipeError, TrainError) as exc:
        print(f"omni-train: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, RecipeError) else 1
    except KeyboardInterrupt:
        if run_dir is not None:  # the last checkpoint stays; the same command resumes too
            print(
                f"omni-train: interrupted; continue with: omni-train resume {run_dir}",
                file=sys.stderr,
            )
        else:
            print("omni-train: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
