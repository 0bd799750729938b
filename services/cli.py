"""`tandem`: the command line. Each subcommand lives in its own module with a `register` function.

Environment variables are read here, once, and passed down as arguments.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from engine.errors import EngineError
from shm.errors import ShmError

SUBCOMMAND_MODULES = (
    "services.cli_bench",
    "services.cli_models",
    "services.cli_run",
    "services.cli_generate",
    "services.cli_serve",
    "services.cli_shm",
)

USER_ERRORS: tuple[type[Exception], ...] = (EngineError, ShmError)


def default_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Serve LLaMA-family models as a tokenizer → scheduler → worker gRPC pipeline.",
    )
    parser.add_argument(
        "--home",
        type=Path,
        default=default_home(),
        help="where model files are cached (default: $TANDEM_HOME or ~/.cache/tandem)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "forwards", False):
        args.argv = rest  # `tandem serve` parses its own settings (and --help)
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as err:
        print(f"tandem {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
