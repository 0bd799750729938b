"""Where a step's GPU time goes: kernel tables for a 2,048-token prefill and for decode steps.

    python -m bench.profile_gpu [--model llama3-8b-random] [--rows 12]

Profiles eager steps (CUDA graphs hide their kernels from the profiler) with torch.profiler and
prints the kernels by total CUDA time. A diagnostic, not a benchmark.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this module as: python -m bench.profile_gpu")

import argparse
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine


def ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def show(title: str, prof: profile, rows: int, steps: int) -> None:
    print(f"\n== {title} (per step: divide by {steps})")
    print(
        prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b-random")
    parser.add_argument("--rows", type=int, default=12)
    args = parser.parse_args()
    home = Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser()
    engine = Engine.from_path(
        registry.resolve(args.model, home),
        "cuda",
        "bfloat16",
        kv_cache_bytes=16 << 30,
        progress=False,
        max_num_seqs=64,
        cuda_graphs=False,
    )
    vocab, bs = engine.config.vocab_size, engine.block_size
    prompt = ids(2048, vocab, 0)
    table = list(range(2048 // bs + 1))
    engine.step([SeqInput("w", prompt, 0, table)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine.step([SeqInput("p", prompt, 0, table)])
        wall = time.perf_counter() - start
    print(f"prefill 2048: {wall * 1000:.1f} ms wall")
    show("prefill 2048", prof, args.rows, 1)

    for batch in (1, 64):
        tables = [list(range(1000 + i * 40, 1040 + i * 40)) for i in range(batch)]
        for i in range(batch):
            engine.step([SeqInput(f"d{i}", ids(512, vocab, i + 1), 0, tables[i])])
        step = [SeqInput(f"d{i}", [7], 512, tables[i]) for i in range(batch)]
        engine.step(step)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(4):
                engine.step(step)
            wall = (time.perf_counter() - start) / 4
        print(f"\neager decode, batch {batch}: {wall * 1000:.2f} ms per step (wall)")
        show(f"decode batch {batch}", prof, args.rows, 4)
        engine.release(s.seq_id for s in step)


if __name__ == "__main__":
    main()
