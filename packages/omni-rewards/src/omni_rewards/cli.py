"""``omni-rewards`` command line: ``score``, ``serve``, ``distill-latent``, ``list``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from PIL import Image

from .base import MissingDependencyError
from .limits import HTTPLimits, RewardLimits
from .options import parse_options
from .registry import available_rewards, load_reward
from .types import RewardInput

__all__ = ["main"]


def _load_media(files: Sequence[str]) -> dict[str, Any]:
    images, latents = [], []
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise SystemExit(f"{f}: no such file")
        if p.suffix == ".safetensors":
            from safetensors.numpy import load_file

            t = load_file(str(p))
            if "data" not in t and len(t) != 1:
                raise SystemExit(
                    f"{f}: expected one tensor (or one named 'data'), found {sorted(t)}"
                )
            arr = t.get("data", next(iter(t.values())))
            latents.extend(
                list(arr) if arr.ndim >= 2 and len(files) == 1 and arr.shape[0] > 1 else [arr]
            )
        else:
            try:
                with Image.open(p) as im:
                    images.append(np.asarray(im.convert("RGB")))
            except OSError as e:
                raise SystemExit(f"{f}: cannot read image ({e})") from e
    if images and latents:
        raise SystemExit("FILES: pass either images or .safetensors latents, not both")
    return {"images": images} if images else {"latents": np.stack(latents)}


def _cmd_score(args: argparse.Namespace) -> int:
    reward = load_reward(args.name, **parse_options(args.option))
    fields = _load_media(args.files)
    n = len(next(iter(fields.values())))
    for flag, key in ((args.prompt, "prompts"), (args.reference, "references")):
        if flag:
            if len(flag) not in (1, n):
                raise SystemExit(
                    f"--{key[:-1]}: give one value or one per file ({n}), got {len(flag)}"
                )
            fields[key] = list(flag) * n if len(flag) == 1 else list(flag)
    out = reward(RewardInput(**fields))
    if args.json:
        print(json.dumps(out.to_json()))
        return 0
    names = args.files if len(args.files) == n else [f"{args.files[0]}[{i}]" for i in range(n)]
    scalar = [k for k, v in out.details.items() if v.ndim == 1]
    header = ["file", "score", *scalar]
    rows = []
    for i in range(n):
        row = [names[i], f"{out.scores[i]:.4f}"]
        for k in scalar:
            v = out.details[k][i]
            row.append(f"{v:.4f}" if isinstance(v, float | np.floating) else str(v))
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for r in [header, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())
    return 0


def _one_line(exc: BaseException) -> str:
    # str(KeyError("x")) is "'x'" (its repr): take the message itself
    key_error = isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str)
    text = " ".join((exc.args[0] if key_error else str(exc)).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): ``prog: error: ... (see --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_limit_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--flag`` per numeric field of a limits dataclass, its default and help."""
    for f in dataclasses.fields(cls):
        if f.type not in ("int", "float"):
            continue
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=int if f.type == "int" else float,
            default=f.default,
            help=f"{f.metadata['help']} (default {f.default:g})",
        )


def limits_from_args(args: argparse.Namespace) -> RewardLimits:
    """The `RewardLimits` of parsed ``serve`` arguments; SystemExit naming a bad flag."""

    def values(cls: type) -> dict[str, Any]:
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name != "http"}

    try:
        return RewardLimits(**values(RewardLimits), http=HTTPLimits(**values(HTTPLimits)))
    except ValueError as exc:
        name = str(exc).split(" ")[0].split(".")[-1]
        raise SystemExit(
            f"omni-rewards serve: --{name.replace('_', '-')}: {_one_line(exc)}"
        ) from None


def _cmd_serve(args: argparse.Namespace) -> int:
    from .base import require_module

    if not 0 < args.port < 65536:
        raise SystemExit(f"omni-rewards serve: --port must be in 1..65535, got {args.port}")
    if args.max_batch < 1:
        raise SystemExit(f"omni-rewards serve: --max-batch must be >= 1, got {args.max_batch}")
    if not 0 <= args.max_wait_ms < float("inf"):
        raise SystemExit(f"omni-rewards serve: --max-wait-ms must be >= 0, got {args.max_wait_ms}")
    limits = limits_from_args(args)
    # a missing extra: main() prints one line
    require_module("uvicorn", "server", "serve", what="omni-rewards serve")
    try:
        reward = load_reward(args.name, **parse_options(args.option))
    except (SystemExit, KeyboardInterrupt, MissingDependencyError):
        raise
    except Exception as exc:  # unknown name, bad option, missing weights: one line
        raise SystemExit(f"omni-rewards serve {args.name}: {_one_line(exc)}") from None
    from .server import serve

    token = args.token or os.environ.get("OMNI_REWARDS_TOKEN")
    serve(
        reward,
        host=args.host,
        port=args.port,
        token=token,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        limits=limits,
        log_level=args.log_level,
    )
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    for name in available_rewards():
        print(name)
    return 0


def _cmd_distill(args: argparse.Namespace) -> int:
    from .latent import distill_main

    return distill_main(args)


def _cmd_convert(args: argparse.Namespace) -> int:
    from .convert import CONVERTERS

    fn = CONVERTERS[args.kind][0]
    extra = {"config": args.config} if args.kind == "imagebind" and args.config else {}
    if args.dst is None and args.kind != "dina-lrm":
        print(
            f"omni-rewards convert: error: dst: {args.kind} needs an output path", file=sys.stderr
        )
        return 2
    try:
        out = fn(args.src, args.dst, **extra)
    except (OSError, ValueError) as exc:
        print(f"omni-rewards convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="omni-rewards", description="Score media with omni-rewards")
    p.add_argument(
        "--version", action="version", version=f"%(prog)s {metadata.version('omni-rewards')}"
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "score", help="score image files (or .safetensors latents) and print a table"
    )
    s.add_argument("name", help="reward name (see `omni-rewards list`)")
    s.add_argument("files", nargs="+")
    s.add_argument(
        "--prompt", action="append", help="prompt (once for all files, or once per file)"
    )
    s.add_argument("--reference", action="append", help="reference (once, or once per file)")
    s.add_argument("--option", "-o", action="append", default=[], help="reward option key=value")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=_cmd_score)

    v = sub.add_parser("serve", help="serve a reward over HTTP")
    v.add_argument("name")
    v.add_argument("--option", "-o", action="append", default=[], help="reward option key=value")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8765)
    v.add_argument("--token", default=None, help="bearer token (or env OMNI_REWARDS_TOKEN)")
    v.add_argument("--max-batch", type=int, default=64, help="most samples per reward batch")
    v.add_argument("--max-wait-ms", type=float, default=5.0, help="coalescing window")
    v.add_argument("--log-level", default="info")
    limits = v.add_argument_group("limits (see the README's 'Server limits')")
    _add_limit_flags(limits, RewardLimits)
    _add_limit_flags(limits, HTTPLimits)
    v.set_defaults(func=_cmd_serve)

    from .convert import CONVERTERS

    c = sub.add_parser(
        "convert",
        help="convert a released torch-pickle checkpoint to safetensors (once)",
        description="Reads the source with torch.load(weights_only=True), only here; the "
        "rewards themselves load safetensors. Kinds: "
        + "; ".join(f"{k}: {h}" for k, (_, h) in CONVERTERS.items()),
    )
    c.add_argument("kind", choices=sorted(CONVERTERS))
    c.add_argument("src", help="the released checkpoint (a DiNa-LRM folder for dina-lrm)")
    c.add_argument("dst", nargs="?", default=None, help="output (dina-lrm: optional)")
    c.add_argument("--config", default=None, help="imagebind: a JSON of ImageBindConfig fields")
    c.set_defaults(func=_cmd_convert)

    lst = sub.add_parser("list", help="list reward names")
    lst.set_defaults(func=_cmd_list)

    d = sub.add_parser(
        "distill-latent",
        help="fit a latent scorer to an image reward on (latent, image) pairs",
        description="Data: a .safetensors file with 'latents' (N, C, H, W), 'images' (N, H, W, 3) "
        "uint8 and optionally 'prompt_embeds' (N, D); or --synthetic N for a built-in demo set.",
    )
    d.add_argument("--teacher", default="brightness", help="image reward to imitate")
    d.add_argument("--teacher-option", action="append", default=[], help="teacher option key=value")
    d.add_argument("--data", default=None, help=".safetensors file with latents and images")
    d.add_argument(
        "--prompts", default=None, help="JSON list of prompts (one per pair) for the teacher"
    )
    d.add_argument(
        "--synthetic", type=int, default=0, help="generate N synthetic pairs instead of --data"
    )
    d.add_argument("--out", required=True, help="output directory for the scorer")
    d.add_argument("--steps", type=int, default=300)
    d.add_argument("--lr", type=float, default=3e-3)
    d.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="pairs a step (a random minibatch); default all",
    )
    d.add_argument("--hidden", type=int, default=64)
    d.add_argument("--holdout", type=float, default=0.2)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-progress", action="store_true", help="no progress bar over the steps")
    d.set_defaults(func=_cmd_distill)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MissingDependencyError as exc:
        # An extra that is not installed (serve without [server], ocr without [ocr], ...): the
        # message names the package and the pip command; a traceback would bury it.
        print(f"omni-rewards: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
