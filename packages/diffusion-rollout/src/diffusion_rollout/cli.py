"""``diffusion-rollout serve --model PATH --port N [--max-num-seqs K]``.

Loads the denoiser with ``omni_adapters.from_pretrained(PATH)``. diffusion-rollout may not
import omni_adapters (docs/architecture.md's import rules, checked by import-linter), so the
default loader imports it by name at run time inside :func:`_load_with_omni_adapters` only;
install ``omni-adapters`` next to this package to serve its models, or pass
``denoiser_factory`` to :func:`main` / :func:`build_server` to serve any other `Denoiser`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any, NoReturn

from .engine import EmbeddedEngine
from .limits import HTTPLimits, RolloutLimits
from .lora import LoraSpec, ensure_lora

__all__ = ["build_parser", "build_server", "lora_spec_from_args", "main"]

TOKEN_ENV = "DIFFUSION_ROLLOUT_TOKEN"

# The import names of the `server` extra's packages (pyproject's [server] list): a serve
# without them prints the pip command instead of a traceback.
SERVER_EXTRA_MODULES = ("starlette", "uvicorn", "httpx", "safetensors", "PIL")


def _load_with_omni_adapters(
    path: str, device: str | None, dtype: str | None = None, options: dict | None = None
) -> Any:
    """The default denoiser factory: ``omni_adapters.from_pretrained(path, device=...,
    dtype=..., **options)`` (``--device``, ``--dtype``, ``--model-options``).

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
    kwargs = dict(options or {})
    if device:
        kwargs["device"] = device
    if dtype:
        kwargs["dtype"] = dtype
    return adapters.from_pretrained(path, **kwargs)


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


def limits_from_args(args: argparse.Namespace) -> RolloutLimits:
    """The `RolloutLimits` of parsed ``serve`` arguments; SystemExit naming a bad flag."""

    def values(cls: type) -> dict[str, Any]:
        return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name != "http"}

    try:
        return RolloutLimits(**values(RolloutLimits), http=HTTPLimits(**values(HTTPLimits)))
    except ValueError as exc:
        name = str(exc).split(" ")[0].split(".")[-1]
        raise SystemExit(
            f"diffusion-rollout serve: --{name.replace('_', '-')}: {_one_line(exc)}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="diffusion-rollout", description="Request-batched diffusion rollout engine."
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {metadata.version('diffusion-rollout')}",
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
        "--dtype",
        default=None,
        help="weights dtype, e.g. bfloat16 (default: the model's; the default loader only)",
    )
    serve.add_argument(
        "--model-options",
        default=None,
        metavar="JSON",
        help="more keyword options for omni_adapters.from_pretrained, a JSON object (the "
        "default loader only)",
    )
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
    limits = serve.add_argument_group("limits (see the README's 'Server limits')")
    _add_limit_flags(limits, RolloutLimits)
    _add_limit_flags(limits, HTTPLimits)
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


def _in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a short-lived thread; its result, or its exception raised here.

    Loading a model runs torch ops, and the first thread that runs one keeps an OpenMP
    thread team for as long as it lives. The server's main thread runs the event loop for
    the server's whole life, so it must not hold a team beside the engine's scheduler
    thread (two teams on the same cores stop libgomp's spin-waiting; `EmbeddedEngine`).
    A team that ends with its thread does not count."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # re-raised in the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="diffusion-rollout-load")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _json_object(text: str | None, flag: str) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"diffusion-rollout serve: {flag}: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"diffusion-rollout serve: {flag}: a JSON object, got {text!r}")
    return value


def build_server(
    args: argparse.Namespace,
    denoiser_factory: Callable[[str, str | None], Any] | None = None,
) -> tuple[Any, EmbeddedEngine]:
    """(Starlette app, engine) for parsed ``serve`` arguments."""
    from .server import create_app

    if not 0 < args.port < 65536:
        raise SystemExit(f"diffusion-rollout serve: --port must be in 1..65535, got {args.port}")
    if args.max_num_seqs < 1:
        raise SystemExit(
            f"diffusion-rollout serve: --max-num-seqs must be >= 1, got {args.max_num_seqs}"
        )
    limits = limits_from_args(args)
    options = _json_object(args.model_options, "--model-options")
    if denoiser_factory is not None and (args.dtype or options):
        raise SystemExit(
            "diffusion-rollout serve: --dtype and --model-options are for the default loader; "
            "this server was given its own denoiser factory"
        )
    factory = denoiser_factory or functools.partial(
        _load_with_omni_adapters, dtype=args.dtype, options=options
    )
    lora = lora_spec_from_args(args)
    try:
        denoiser = _in_own_thread(factory, args.model, args.device)
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as exc:  # a missing folder, a broken config: one line, no traceback
        raise SystemExit(
            f"diffusion-rollout serve: cannot load --model {args.model}: {_one_line(exc)}"
        ) from None
    if lora is not None:
        try:
            _in_own_thread(ensure_lora, denoiser, lora)
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"diffusion-rollout serve: --lora-*: {_one_line(exc)}") from None
    try:
        engine = EmbeddedEngine(
            denoiser,
            max_num_seqs=args.max_num_seqs,
            max_wait_ms=args.max_wait_ms,
            version=args.version,
            version_timeout_s=args.version_timeout_s,
            max_wave_pixels=limits.max_wave_pixels,
        )
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"diffusion-rollout serve: {_one_line(exc)}") from None
    token = args.token or os.environ.get(TOKEN_ENV) or None
    return create_app(engine, token=token, limits=limits), engine


def main(
    argv: Sequence[str] | None = None,
    *,
    denoiser_factory: Callable[[str, str | None], Any] | None = None,
) -> int:
    """Entry point of the ``diffusion-rollout`` command."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        try:
            from .serving import run

            app, engine = build_server(args, denoiser_factory)
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").split(".")[0]
            if missing not in SERVER_EXTRA_MODULES:
                raise
            print(
                f"diffusion-rollout: error: serve needs the python package {missing!r}, which "
                "is not installed: pip install 'diffusion-rollout[server]'",
                file=sys.stderr,
            )
            return 1
        if args.host not in ("127.0.0.1", "localhost", "::1") and not (
            args.token or os.environ.get(TOKEN_ENV)
        ):
            print(f"warning: serving on {args.host} without a bearer token", file=sys.stderr)
        try:
            run(
                app,
                host=args.host,
                port=args.port,
                limits=app.state.limits.http,
                log_level=args.log_level,
            )
        finally:
            engine.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
