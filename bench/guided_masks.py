"""The host's part of holding output to a form: one step's token masks for N sequences, each
following a JSON Schema's text, with LLaMA-3's vocabulary encoded by llguidance itself
(tiktoken's ranks, as tandem gives it) or through Python (as a `tokenizers` vocabulary is),
in a loop or on llguidance's threads. Mean ms of a step over the text's tokens."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from bench.cli import first_paragraph, json_option, tandem_home
from engine import registry
from engine.guided import OutputFormat, _Vocabulary, compile_format, grammar_tokenizer
from engine.tokenizer import Llama3Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "tags"],
}
TEXT = '{"name": "Alice", "age": 30, "city": "Paris", "tags": ["a", "b"]}'


def mask_steps(
    vocabulary: llguidance.LLTokenizer, ids: list[int], rows: int, threads: int
) -> list[float]:
    """ms of each step's masks, every row having taken the text's tokens so far."""
    grammar = compile_format(OutputFormat("json_schema", json.dumps(SCHEMA)), vocabulary)
    matchers = [llguidance.LLMatcher(vocabulary, grammar, log_level=0) for _ in range(rows)]
    masks = np.zeros((rows, (vocabulary.vocab_size + 31) // 32), dtype=np.int32)
    executor = llguidance.LLExecutor(threads) if threads > 1 else None
    times = []
    for token in ids:
        started = time.perf_counter()
        if executor is not None:
            fill_next_token_bitmask_par(executor, [(m, r) for r, m in enumerate(matchers)], masks)
        else:
            for r, m in enumerate(matchers):
                fill_next_token_bitmask(m, masks, r)
        times.append(1000 * (time.perf_counter() - started))
        for m in matchers:
            assert m.consume_token(token)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    json_option(parser, "RESULTS-guided-masks.json")
    args = parser.parse_args(argv)
    tokenizer = Llama3Tokenizer(registry.fetch_any(registry.lookup("llama3"), tandem_home(), True))
    ids = tokenizer.encode(TEXT, allow_special=False)
    vocabularies = {
        "llguidance's own": grammar_tokenizer(tokenizer, tokenizer.vocab_size),
        "through Python": llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Vocabulary(tokenizer)),
            n_vocab=tokenizer.vocab_size,
            eos_token=sorted(tokenizer.eos_token_ids),
        ),
    }
    results: list[dict[str, Any]] = []
    print("| encoding | threads | sequences | mean ms a step | median |")
    print("|---|---:|---:|---:|---:|")
    for name, vocabulary in vocabularies.items():
        for threads in args.threads:
            for rows in args.rows:
                times = mask_steps(vocabulary, ids, rows, threads)
                mean, median = statistics.mean(times), statistics.median(times)
                results.append(dict(encoding=name, threads=threads, rows=rows, ms=times))
                print(f"| {name} | {threads} | {rows} | {mean:.2f} | {median:.2f} |", flush=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
