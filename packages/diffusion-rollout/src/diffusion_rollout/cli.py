"""``diffusion-rollout serve --model PATH --port N [--max-num-seqs K]``.

Loads the denoiser with ``omni_adapters.from_pretrained(PATH)``. diffusion-rollout may not
import omni_adapters (DESIGN.md's import rules, checked by import-linter), so the default
loader imports it by name at run time inside :func:`_load_with_omni_adapters` only; install
``omni-adapters`` next to this package to serve its models, or pass ``denoiser_factory``
to :func:`main` / :func:`build_server` to serve any other `Denoiser`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .engine import EmbeddedEngine
from .lora import LoraSpec, ensure_lora

__all__ = ["build_parser", "build_server", "lora_spec_from_args", "main"]

TOKEN_ENV = "DIFFUSION_ROLLOUT_TOKEN"


def _load_with_omni_adapters(path: str, device: str | None) -> Any:
    """The default denoiser factory: ``omni_adapters.from_pretrained(path, device=...)``.

    Imported by name here, at run time, so the package itself never depends on
    omni_adapters (the import-linter contract stays clean).
    """
    try:
        adapters = importlib.import_module("omni_adapters")
    except ImportError as exc:
        raise SystemExit(
            "diffusion-rollout serve --model needs omni-adapters (pip install omni-adapters), "
            f"or pass a denoiser_factory to diffusion_rollout.cli.main: {exc}"
        ) from None
    options = {"device": device} if device else {}
    return adapters.from_pretrained(path, **options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffusion-rollout", description="Request-batched diffusion rollout engine."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve an engine over HTTP")
    serve.add_argument("--model", required=True, help="saved model folder (omni_adapters)")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--max-num-seqs", type=int, default=16)
    serve.add_argument(
        "--max-wait-ms",
        type=float,
        default=5.0,
        help="how long a wave waits for more requests (default 5)",
    )
    serve.add_argument("--version", type=int, default=0, help="initial weights version")
    serve.add_argument("--version-timeout-s", type=float, default=60.0)
    serve.add_argument("--device", default=None, help="e.g. cuda, cuda:1, cpu")
    serve.add_argument(
        "--token", default=None, help=f"bearer token (prefer the {TOKEN_ENV} environment variable)"
    )
    serve.add_argument("--log-level", default="info")
    # The LoRA adapter pushed weights fill (else the first update's lora_config adds it).
    serve.add_argument("--lora-rank", type=int, default=None, help="LoRA rank r")
    serve.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (scale a/r)")
    serve.add_argument(
        "--lora-targets",
        default=None,
        help="comma-separated LoRA target modules (default: the model's own)",
    )
    return parser


def lora_spec_from_args(args: argparse.Namespace) -> LoraSpec | None:
    """The `LoraSpec` of ``--lora-rank/--lora-alpha/--lora-targets`` (None without them)."""
    rank, alpha, targets = args.lora_rank, args.lora_alpha, args.lora_targets
    if rank is None and alpha is None and targets is None:
        return None
    if rank is None or alpha is None:
        raise SystemExit("--lora-rank and --lora-alpha go together (alpha is never guessed)")
    names = tuple(t.strip() for t in (targets or "").split(",") if t.strip())
    try:
        return LoraSpec(rank, alpha, names)
    except ValueError as exc:
        raise SystemExit(f"--lora-*: {exc}") from None


def build_server(
    args: argparse.Namespace,
    denoiser_factory: Callable[[str, str | None], Any] | None = None,
) -> tuple[Any, EmbeddedEngine]:
    """(Starlette app, engine) for parsed ``serve`` arguments."""
    from .server import create_app

    if not 0 < args.port < 65536:
        raise SystemExit(f"--port must be in 1..65535, got {args.port}")
    if args.max_num_seqs < 1:
        raise SystemExit(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    factory = denoiser_factory or _load_with_omni_adapters
    lora = lora_spec_from_args(args)
    denoiser = factory(args.model, args.device)
    if lora is not None:
        ensure_lora(denoiser, lora)
    engine = EmbeddedEngine(
        denoiser,
        max_num_seqs=args.max_num_seqs,
        max_wait_ms=args.max_wait_ms,
        version=args.version,
        version_timeout_s=args.version_timeout_s,
    )
    token = args.token or os.environ.get(TOKEN_ENV) or None
    return create_app(engine, token=token), engine


def main(
    argv: Sequence[str] | None = None,
    *,
    denoiser_factory: Callable[[str, str | None], Any] | None = None,
) -> int:
    """Entry point of the ``diffusion-rollout`` command."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        import uvicorn

        app, engine = build_server(args, denoiser_factory)
        if args.host not in ("127.0.0.1", "localhost", "::1") and not (
            args.token or os.environ.get(TOKEN_ENV)
        ):
            print(f"warning: serving on {args.host} without a bearer token", file=sys.stderr)
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        finally:
            engine.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
