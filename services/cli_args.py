"""Flags shared by the commands that generate (`run`, `generate`, `chat`), and their parsing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_prompt_args(parser: argparse.ArgumentParser) -> None:
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument(
        "--prompt-ids", type=parse_ids, metavar="ID,ID,...", help="the prompt as token ids"
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap --prompt as one user message in the chat template"
    )
    parser.add_argument("--system", help="with --chat: a system message before the prompt")


def parse_seed(text: str) -> int:
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if not 0 <= seed < 1 << 63:  # the engine's range (engine/sampling_params.py)
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**63-1, got {text!r}")
    return seed


# The sampling flags, passed on by name: flag -> (type, default, help).
SAMPLING_FLAGS: dict[str, tuple[Callable[[str], Any], Any, str]] = {
    "temperature": (float, 0.0, "0 (the default) is greedy decoding"),
    "top_p": (float, 1.0, "nucleus sampling mass (1: off)"),
    "top_k": (int, 0, "keep the k most likely (0: off)"),
    "min_p": (float, 0.0, "drop below min-p × best (0: off)"),
    "repetition_penalty": (float, 1.0, "1: off"),
    "presence_penalty": (float, 0.0, "0: off"),
    "frequency_penalty": (float, 0.0, "0: off"),
    "seed": (parse_seed, None, "makes sampling reproducible (0 to 2**63-1)"),
    "logprobs": (int, 0, "top-n logprobs per token (JSON)"),
}


def add_sampling_args(
    parser: argparse.ArgumentParser, *, max_tokens: int | None = 256, json_flag: bool = True
) -> None:
    """`max_tokens=None` leaves the limit to the server; `json_flag=False` omits `--json`."""
    limit = "up to 256, within the context" if max_tokens is None else max_tokens
    parser.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"tokens to generate ({limit})"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens"
    )
    for name, (kind, default, help_text) in SAMPLING_FLAGS.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=default, help=help_text
        )
    parser.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    if json_flag:
        parser.add_argument(
            "--json", action="store_true", help="print one JSON object instead of streaming text"
        )


def parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags by name (`SamplingParams(**...)` offline; the client's options)."""
    return {name: getattr(args, name) for name in SAMPLING_FLAGS}


def chat_messages(args: argparse.Namespace) -> list[dict[str, str]]:
    if args.prompt is None:
        raise SystemExit(
            f"tandem {args.command}: error: --chat needs --prompt text, not --prompt-ids"
        )
    messages = [{"role": "system", "content": args.system}] if args.system else []
    return [*messages, {"role": "user", "content": args.prompt}]


def add_format_args(parser: argparse.ArgumentParser) -> None:
    form = parser.add_argument_group(
        "output format",
        "hold the reply to a form (guided decoding); it ends once the form is complete",
    )
    forms = form.add_mutually_exclusive_group()
    forms.add_argument("--json-object", action="store_true", help="any JSON object")
    forms.add_argument(
        "--json-schema", metavar="FILE", help="a JSON value this JSON Schema accepts (- : stdin)"
    )
    forms.add_argument("--regex", help="text the regex matches whole")
    forms.add_argument(
        "--grammar", metavar="FILE", help="a sentence of this Lark or GBNF grammar (- : stdin)"
    )
    forms.add_argument(
        "--choice", action="append", metavar="TEXT", help="one of these texts (repeat the flag)"
    )


def format_from_args(args: argparse.Namespace) -> tuple[str, Any] | None:
    """(kind, value) of the format flags: json_object True, json_schema and grammar the file's
    text, regex the pattern, choice the texts; None without one. InvalidOption for a file it
    cannot read."""
    from services.client_types import InvalidOption

    if args.json_object:
        return "json_object", True
    for kind in ("json_schema", "grammar"):
        path = getattr(args, kind)
        if path is not None:
            try:
                text = sys.stdin.read() if path == "-" else Path(path).read_text()
            except OSError as err:
                flag = "--" + kind.replace("_", "-")
                raise InvalidOption(f"{flag}: cannot read {path}: {err.strerror}") from None
            return kind, text  # what is wrong with it is said where it is compiled
    if args.regex is not None:
        return "regex", args.regex
    if args.choice:
        return "choice", args.choice
    return None
