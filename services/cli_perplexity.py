"""`tandem perplexity`: a text file's perplexity under a model, in this process
(engine/perplexity.py says how it is measured: as llama.cpp's `llama-perplexity`, so the
numbers compare)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from engine import registry
from engine.errors import EngineError
from services.cli_run import add_model_args, load_tokenizer_of
from services.settings import add_flags, build
from services.worker.config import EngineSettings


def register(sub: argparse._SubParsersAction) -> None:
    ppl = sub.add_parser(
        "perplexity",
        help="a text file's perplexity under a model, offline (as llama-perplexity measures it)",
        description="Cut a text file's tokens into windows of --ctx, score the second half of "
        "each given what comes before it, and print exp of the mean negative logprob, with its "
        "standard error: how well a model (or a weight format of it) predicts the text. The same "
        "measure as llama.cpp's llama-perplexity, so the two compare on the same GGUF.",
    )
    add_model_args(ppl)
    ppl.add_argument("--file", type=Path, required=True, help="the text (UTF-8)")
    ppl.add_argument(
        "--ctx", type=int, default=512, help="tokens per window (default 512, llama.cpp's)"
    )
    ppl.add_argument(
        "--step-tokens", type=int, default=2048, help="tokens prefilled a step (default 2048)"
    )
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    add_flags(ppl.add_argument_group("engine"), EngineSettings, os.environ)
    ppl.set_defaults(func=_perplexity, user_errors=(EngineError, OSError))


def _perplexity(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.perplexity import perplexity, windows
    from engine.rank_group import start_engine

    text = args.file.read_text(encoding="utf-8")  # before the model loads: a wrong path fails fast
    settings = build(EngineSettings, vars(args))
    model_path = registry.resolve(args.model, args.home)
    tokenizer = load_tokenizer_of(args, model_path)
    ids = tokenizer.encode_prompt(text, allow_special=False, field="--file")
    bos = tokenizer.bos_token_id if tokenizer.add_bos else None
    count = len(windows(ids, args.ctx, bos))
    engine = start_engine(settings.engine_args(model_path), settings.tensor_parallel_size)
    try:
        started = time.perf_counter()
        with tqdm(total=count, unit="window", desc="perplexity", file=sys.stderr) as bar:

            def advance(windows_done: int, so_far: float) -> None:
                bar.set_postfix(ppl=f"{so_far:.4f}", refresh=False)
                bar.update(windows_done)

            result = perplexity(engine, ids, args.ctx, bos, args.step_tokens, advance)
        seconds = time.perf_counter() - started
    finally:
        engine.close()
    rate = result.windows * args.ctx / seconds
    if args.json:
        out = {
            "perplexity": result.perplexity,
            "error": result.error,
            "ctx": args.ctx,
            "windows": result.windows,
            "tokens": len(ids),
            "tokens_scored": result.tokens_scored,
            "seconds": seconds,
            "tokens_per_s": rate,
        }
        print(json.dumps(out))
    else:
        print(
            f"perplexity {result.perplexity:.4f} ± {result.error:.4f} over {result.windows} "
            f"windows of {args.ctx} tokens ({result.tokens_scored} scored of {len(ids)}; "
            f"{rate:.0f} tokens/s)"
        )
    return 0
