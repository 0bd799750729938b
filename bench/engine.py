"""Engine throughput on the default model: 512-token prefill, and decode at batch 1, 8 and 32.

    python -m bench.engine [--model NAME_OR_PATH] [--device cpu|cuda] [--dtype float32]
                           [--json PATH] [--decode-steps 32]

Prints a table and writes the numbers as JSON. Timings, not assertions: the machine is shared.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    # Run as a script, this file would shadow the `engine` package it measures.
    sys.exit("run this benchmark as a module: python -m bench.engine")

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.cli import first_paragraph, tandem_home, write_json
from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_prefill(engine: Engine, prompt_len: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(0)
    table = list(range(-(-prompt_len // engine.block_size)))
    times = []
    for r in range(repeats + 1):
        ids = torch.randint(0, engine.config.vocab_size, (prompt_len,), generator=gen).tolist()
        sync(engine.device)
        start = time.perf_counter()
        engine.step([SeqInput(f"p{r}", ids, 0, table)])
        sync(engine.device)
        if r:  # the first run warms up
            times.append(time.perf_counter() - start)
    return prompt_len / statistics.median(times)


def bench_decode(engine: Engine, batch: int, context: int, steps: int) -> float:
    gen = torch.Generator().manual_seed(1)
    blocks_per_seq = -(-(context + steps + 1) // engine.block_size)
    seqs = []
    for b in range(batch):
        ids = torch.randint(0, engine.config.vocab_size, (context,), generator=gen).tolist()
        table = list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq))
        seqs.append((f"d{b}", table))
        engine.step([SeqInput(f"d{b}", ids, 0, table)])
    last = [1] * batch
    times = []
    for step in range(steps + 2):
        batch_in = [
            SeqInput(seq_id, [last[i]], context + step, table)
            for i, (seq_id, table) in enumerate(seqs)
        ]
        sync(engine.device)
        start = time.perf_counter()
        outs = engine.step(batch_in)
        sync(engine.device)
        if step >= 2:  # warm-up steps
            times.append(time.perf_counter() - start)
        last = [o.token_id for o in outs]
    return batch / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--model", default=registry.DEFAULT_MODEL)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--context", type=int, default=128, help="prompt length before decoding")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--json", type=Path, default=Path("bench/engine.json"))
    args = parser.parse_args()

    home = tandem_home()
    path = registry.resolve(args.model, home)
    batches = [int(b) for b in args.batches.split(",")]
    needed = max(batches) * -(-(args.context + args.decode_steps + 3) // 16)
    needed = max(needed, -(-args.prompt_len // 16))
    engine = Engine.from_path(path, args.device, args.dtype, kv_cache_bytes=0, progress=True)
    engine = Engine(engine.loaded, num_kv_blocks=needed, block_size=16)

    rows = [("prefill", args.prompt_len, 1, bench_prefill(engine, args.prompt_len, 3))]
    for b in batches:
        rows.append(
            ("decode", args.context, b, bench_decode(engine, b, args.context, args.decode_steps))
        )

    print(
        f"\nengine on {args.device} ({args.dtype}), {path.name}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'phase':<8} {'context':>8} {'batch':>6} {'tokens/s':>10}")
    for phase, ctx, b, rate in rows:
        print(f"{phase:<8} {ctx:>8} {b:>6} {rate:>10.1f}")
    result = {
        "model": path.name,
        "device": args.device,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "results": [
            {"phase": p, "context": c, "batch": b, "tokens_per_s": r} for p, c, b, r in rows
        ],
    }
    write_json(args.json, result)


if __name__ == "__main__":
    main()
