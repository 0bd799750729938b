"""`tandem`: the command line. Each command lives in its own module with a `register` function,
imported only when that command runs, so a client command starts without the engine or torch.

Environment variables are read here, once, and passed down as arguments.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

# Command -> (the module that registers it, its one-line help for `tandem --help`).
COMMANDS = {
    "serve": ("services.cli_serve", "start the tokenizer, scheduler and worker processes"),
    "generate": ("services.cli_generate", "stream one generation from a running server"),
    "chat": ("services.cli_generate", "talk to a running server, turn by turn"),
    "bench": ("services.cli_bench", "measure servers (tandem, or OpenAI-compatible) under load"),
    "run": ("services.cli_run", "generate offline with the engine in this process (no servers)"),
    "tokenize": ("services.cli_run", "print the token ids of a text"),
    "perplexity": (
        "services.cli_perplexity",
        "a text file's perplexity under a model, offline (as llama-perplexity measures it)",
    ),
    "models": ("services.cli_models", "list or fetch the models you can name"),
    "shm": ("services.cli_shm", "show or clean up shared-memory segments"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with `command`'s full flags (the others only named, with their help)."""
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Serve LLaMA-family models as a tokenizer → scheduler → worker gRPC pipeline.",
    )
    parser.add_argument(
        "--home",
        type=Path,
        default=Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser(),
        help="where model files are cached (default: $TANDEM_HOME or ~/.cache/tandem)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if command in COMMANDS:
        importlib.import_module(COMMANDS[command][0]).register(sub)
    for name, (_, help_text) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The command named in argv: its first word that is not an option of `tandem` itself."""
    words = iter(argv)
    for word in words:
        if word == "--home":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command_of(argv))
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "forwards", False):
        args.argv = rest  # `tandem serve` parses its own settings (and --help)
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args.func(args) or 0)
    except getattr(args, "user_errors", ()) as err:  # errors that name what is wrong
        print(f"tandem {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
