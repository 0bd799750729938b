"""Steps with prompts beside decodes: the piecewise CUDA graphs against eager launches.

Side by side on one engine: the host's time to launch the step, the step's wall time
(launch and sync) and the GPU's time alone (the step queued behind a sleep kernel, so that no
launch is waited for). A step whose launch takes longer than its GPU time is host-bound.

    python -m bench.mixed_steps [--model llama3-8b-random] [--json PATH]
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this module as: python -m bench.mixed_steps")

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.cli import first_paragraph, json_option, tandem_home, write_json
from bench.gpu_measure import random_prompt
from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine

# (prompts, tokens each, decodes at 640 tokens of context)
STEPS = [(1, 16, 8), (1, 128, 64), (1, 448, 64), (1, 128, 256), (1, 192, 256), (8, 128, 256)]
CONTEXT = 640


def batch(engine: Engine, prompts: int, tokens: int, decodes: int) -> list[SeqInput]:
    rows, block, bs = [], 0, engine.block_size
    for i in range(prompts):
        n = -(-tokens // bs)
        ids = random_prompt(tokens, engine.config.vocab_size, 3 + i)
        rows.append(SeqInput(f"p{i}", ids, 0, list(range(block, block + n))))
        block += n
    for i in range(decodes):  # decodes first in a real step; the order costs nothing here
        n = CONTEXT // bs
        rows.append(SeqInput(f"d{i}", [5], CONTEXT - 1, list(range(block, block + n))))
        block += n
    return rows


def measure(engine: Engine, rows: list[SeqInput], repeats: int = 7) -> dict[str, float]:
    for _ in range(3):
        engine.forward(rows)
        torch.cuda.synchronize()
    launches, walls = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.forward(rows)
        launched = time.perf_counter()
        torch.cuda.synchronize()
        launches.append(launched - start)
        walls.append(time.perf_counter() - start)
    # ~100 ms of spinning (at ~2 GHz) ahead of the step: its launches are queued long before
    # the GPU reaches them, so the events time the kernels alone.
    torch.cuda._sleep(200_000_000)
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    engine.forward(rows)
    last.record()
    torch.cuda.synchronize()
    return dict(
        host_launch_ms=statistics.median(launches) * 1e3,
        wall_ms=statistics.median(walls) * 1e3,
        gpu_ms=first.elapsed_time(last),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--model", default="llama3-8b-random", help="a registry name or a path")
    json_option(parser, "mixed_steps.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.mixed_steps compares CUDA graphs with eager launches: it needs a GPU")
    home = tandem_home()
    path = Path(args.model) if Path(args.model).exists() else registry.resolve(args.model, home)
    engine = Engine.from_path(
        path, "cuda", "bfloat16", kv_cache_bytes=40 << 30, progress=False, max_num_seqs=256
    )
    pieces = engine.piecewise
    if pieces is None:
        sys.exit("this engine has no piecewise graphs (a tensor-parallel rank, or graphs off)")
    print(f"{torch.cuda.get_device_name()}; start-up {engine.start_times}")
    print(f"{'step':<26} {'launch':>8} {'wall':>8} {'GPU':>8}   (ms; pieces / eager)")
    rows = []
    for prompts, tokens, decodes in STEPS:
        step = batch(engine, prompts, tokens, decodes)
        found = {}
        for mode, graphs in (("pieces", pieces), ("eager", None)):
            engine.piecewise = graphs
            found[mode] = measure(engine, step)
        engine.piecewise = pieces
        label = f"{prompts} x {tokens} + {decodes} decodes"
        if pieces.bucket(prompts * tokens + decodes) is None:
            label += " (eager both)"
        cells = [
            f"{found['pieces'][k]:>5.2f} / {found['eager'][k]:<5.2f}"
            for k in ("host_launch_ms", "wall_ms", "gpu_ms")
        ]
        print(f"{label:<26} {'  '.join(cells)}", flush=True)
        rows.append(dict(prompts=prompts, tokens=tokens, decodes=decodes, **found))
    write_json(args.json, dict(device=torch.cuda.get_device_name(), rows=rows))


if __name__ == "__main__":
    main()
