"""Whether launching a step waits for the device: each kind of eager step is submitted behind
~40 ms of queued matmuls, and its launch timed; then submitted again under torch's sync debug
mode, which names each synchronising call it catches.

    python -m bench.launch_waits [--model llama3-8b-random] [--json PATH]

A launch that waits holds whatever the caller does after it: the worker sends the step before's
tokens only once the next step with prefill is launched. A launch far shorter than the queue
left behind it did not wait. The debug mode does not see every wait (the driver's staging of a
large upload from pageable memory is one it misses), hence both columns. A diagnostic on CUDA.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this module as: python -m bench.launch_waits")

import argparse
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from bench.cli import first_paragraph, json_option, tandem_home, write_json
from bench.gpu_measure import random_prompt
from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine
from engine.warm_up import PENALISED, SAMPLED


def cases(engine: Engine) -> dict[str, list[SeqInput]]:
    vocab, bs = engine.config.vocab_size, engine.block_size

    def table(first: int, ctx: int) -> list[int]:
        n = -(-(ctx + 1) // bs)
        return list(range(first * n, (first + 1) * n))

    def prompt(name: str, n: int, at: int, first: int, **kw: Any) -> SeqInput:
        return SeqInput(name, random_prompt(n, vocab, first), at, table(first, at + n), **kw)

    decodes = [SeqInput(f"d{i}", [i], 640, table(10 + i, 640)) for i in range(64)]
    sampled = [SeqInput(d.seq_id, d.token_ids, 640, d.block_table, SAMPLED) for d in decodes]
    penalised = SeqInput(
        "pen", [5], 640, table(9, 640), PENALISED, prompt_len=300,
        prefix_ids=random_prompt(640, vocab, 4),
    )  # fmt: skip
    three = [prompt(f"q{i}", 400, 0, 1 + i) for i in range(3)]
    chunk = prompt("c", 1024, 1024, 4, sample=False)
    return {
        "prefill 2,048": [prompt("p", 2048, 0, 0)],
        "3 prompts of 400 + 64 decodes": [*three, *decodes],
        "chunk of 1,024 at 1,024 + 64 decodes": [chunk, *decodes],
        "chunk of 2,048 at 2,048": [prompt("c2", 2048, 2048, 5)],
        "400 sampled + 64 sampled decodes": [prompt("s", 400, 0, 6, sampling=SAMPLED), *sampled],
        "one penalised decode": [penalised],
    }


def syncs_in_submit(engine: Engine, batch: list[SeqInput]) -> list[str]:
    """Where the engine's code called something synchronising while launching `batch`."""
    seen: list[str] = []

    def note(*_: Any, **__: Any) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "/engine/" in f.filename]
        seen.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[::-1][:3]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            submitted = engine.submit(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    engine.collect(submitted)
    engine.release(s.seq_id for s in batch)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--model", default="llama3-8b-random")
    json_option(parser, "launch_waits.json")
    args = parser.parse_args()
    home = tandem_home()
    engine = Engine.from_path(
        registry.resolve(args.model, home), "cuda", "bfloat16", kv_cache_bytes=16 << 30,
        progress=False, max_num_seqs=256,
    )  # fmt: skip
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    print(f"{'step':<40} {'launch ms':>10} {'queue left ms':>14}  synchronising calls")
    rows = []
    for name, batch in cases(engine).items():
        engine.step(batch)  # compiled and warm
        engine.release(s.seq_id for s in batch)
        torch.cuda.synchronize()
        for _ in range(30):
            busy @ busy
        start = time.perf_counter()
        submitted = engine.submit(batch)
        launch = time.perf_counter() - start
        start = time.perf_counter()
        torch.cuda.synchronize()
        left = time.perf_counter() - start
        engine.collect(submitted)
        engine.release(s.seq_id for s in batch)
        where = syncs_in_submit(engine, batch)
        print(f"{name:<40} {launch * 1e3:>10.1f} {left * 1e3:>14.1f}  {len(where)}")
        for place in sorted(set(where)):
            print(f"{'':<40} at {place or '(no engine frame)'}")
        rows.append({"step": name, "launch_s": launch, "queue_left_s": left, "syncs": where})
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
