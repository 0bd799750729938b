"""`tandem run` (offline generation with the engine alone) and `tandem tokenize`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine import registry
from engine.errors import EngineError
from engine.tokenizer import Tokenizer
from services.cli_args import (
    add_format_args,
    add_prompt_args,
    add_sampling_args,
    chat_messages,
    format_from_args,
    sampling_from_args,
)
from services.settings import add_flags, build
from services.worker.config import EngineSettings

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams


def register(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run",
        help="generate offline with the engine in this process (no servers)",
        description="Load a model and stream a generation to the terminal, in this process.",
    )
    add_model_args(run)
    run.add_argument(
        "--chat-template",
        help="with --chat: a Jinja chat template (a file's path, or the text itself) instead "
        "of the model's",
    )
    add_prompt_args(run)
    add_sampling_args(run)
    add_format_args(run)
    add_flags(run.add_argument_group("engine"), EngineSettings, os.environ)
    run.set_defaults(func=_run, user_errors=(EngineError,))

    tok = sub.add_parser("tokenize", help="print the token ids of a text")
    add_model_args(tok)
    tok.add_argument("--text", required=True, help="the text to tokenize")
    tok.add_argument(
        "--special",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="special-token text such as <|eot_id|> becomes that token (the default, as in a "
        "raw prompt); --no-special encodes it as the characters it is (as chat content is)",
    )
    tok.add_argument("--json", action="store_true", help='print {"token_ids": [...]}')
    tok.set_defaults(func=_tokenize, user_errors=(EngineError,))


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=registry.DEFAULT_MODEL,
        help=f"a model name (see `tandem models list`) or a path to a GGUF file or HF folder "
        f"(default {registry.DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--tokenizer", help="a tokenizer name or path, instead of the model's own (e.g. llama3)"
    )


def load_tokenizer_of(args: argparse.Namespace, model_path: Path | None) -> Tokenizer:
    """The model's tokenizer, or --tokenizer's; with --chat-template's template where given."""
    from engine.tokenizer import load_chat_template, load_tokenizer

    if args.tokenizer:
        tokenizer = load_tokenizer(registry.resolve(args.tokenizer, args.home))
    else:
        tokenizer = load_tokenizer(model_path or registry.resolve(args.model, args.home))
    if getattr(args, "chat_template", None):
        tokenizer.chat_template = load_chat_template(args.chat_template)
    return tokenizer


def _tokenize(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer_of(args, None)
    ids = tokenizer.encode(args.text, allow_special=args.special, field="--text")
    if args.json:
        print(json.dumps({"token_ids": ids}))
    else:
        for i in ids:
            print(f"{i:>7}  {tokenizer.token_bytes(i)!r}")
    return 0


def _run(args: argparse.Namespace) -> int:
    import torch

    from engine.rank_group import start_engine
    from engine.sampling_params import SamplingParams

    sampling = SamplingParams(**sampling_from_args(args))
    e = build(EngineSettings, vars(args))
    model_path = registry.resolve(args.model, args.home)
    tokenizer = load_tokenizer_of(args, model_path)
    if args.chat:
        prompt_ids = tokenizer.encode_chat(chat_messages(args))
    elif args.prompt is not None:
        prompt_ids = tokenizer.encode_prompt(args.prompt, allow_special=True, field="--prompt")
    else:
        prompt_ids = args.prompt_ids
    sampling = _held(args, sampling, tokenizer)
    ranks = e.tensor_parallel_size
    if ranks > 1 and e.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // ranks))  # the cores, shared
    engine = start_engine(e.engine_args(model_path), ranks)
    try:
        return _generate(args, engine, tokenizer, prompt_ids, sampling)
    finally:
        engine.close()


def _held(
    args: argparse.Namespace, sampling: SamplingParams, tokenizer: Tokenizer
) -> SamplingParams:
    """`sampling` with the grammar of the format flags, compiled as the server's edge does."""
    import dataclasses

    from engine.errors import InvalidRequest
    from engine.guided import OutputFormat, compile_format, grammar_tokenizer

    form = format_from_args(args)
    if form is None:
        return sampling
    kind, value = form
    field = f"--{kind.replace('_', '-')}"
    if args.ignore_eos:
        raise InvalidRequest("--ignore-eos", f"cannot be used with {field}")
    if kind == "choice":
        value = tuple(value)
    elif kind == "json_object":
        value = ""
    fmt = OutputFormat(kind, value, field)  # type: ignore[arg-type]
    grammar = compile_format(fmt, grammar_tokenizer(tokenizer, tokenizer.vocab_size))
    return dataclasses.replace(sampling, grammar=grammar)


def _generate(
    args: argparse.Namespace,
    engine: Engine,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    sampling: SamplingParams,
) -> int:
    from engine.generate import Generation, GenerationRequest, generate

    request = GenerationRequest(
        prompt_ids=prompt_ids,
        sampling=sampling,
        max_tokens=args.max_tokens,
        stop_token_ids=frozenset() if args.ignore_eos else tokenizer.eos_token_ids,
        stop_strings=tuple(args.stop),
    )
    result = Generation()
    started = time.perf_counter()
    first = None
    for delta in generate(engine, tokenizer, request, result):
        first = first or time.perf_counter()
        if not args.json:
            print(delta.text, end="", flush=True)
    decode = time.perf_counter() - (first or started)
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(result.token_ids)}
    if args.json:
        out = {
            "prompt_token_ids": prompt_ids,
            "token_ids": result.token_ids,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "usage": usage,
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        rate = (len(result.token_ids) - 1) / decode if decode > 0 else 0.0
        print(
            f"\n[{usage['prompt_tokens']} prompt + {usage['completion_tokens']} generated tokens, "
            f"finish: {result.finish_reason}, {rate:.1f} tok/s decode]",
            file=sys.stderr,
        )
    return 0
