"""One-row decode at a long context on the CPU with the KV pool on transparent huge pages (as
the engine allocates it) against the same pool on plain 4 KB pages, side by side in one engine,
alternating, on the default model: with the sequence's blocks scattered over the pool (as on a
server that has run a while) and in order (a fresh one).

    python -m bench.cpu_kv_pages [--context 2000] [--steps 32] [--rounds 3] [--json PATH]

A decode step reads every layer's K/V of the sequence, block by block; with 16-token blocks a
block is 24 KB (the default model), so a step's reads come in short runs from scattered pages.
Prints the fastest round's median step of each (pool, layout), and checks that the two pools
give the same logits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.cli import first_paragraph, json_option, tandem_home, write_json
from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, logprobs=1)


def decode_steps(engine: Engine, context: int, table: list[int], steps: int) -> list[float]:
    """Seconds of each of `steps` one-row decode steps at position `context` (the same
    position each time: the step writes its own K/V there and reads the context before it)."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step([SeqInput("d", [1000], context, table, sampling=GREEDY)])
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--model", default=registry.DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=2000, help="tokens before the decode")
    parser.add_argument("--steps", type=int, default=32, help="decode steps a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each pool and layout")
    json_option(parser, "cpu_kv_pages.json")
    args = parser.parse_args()
    engine = Engine.from_path(registry.resolve(args.model, tandem_home()), progress=False)
    if engine.native is None:
        raise SystemExit("the one-row decode measured here needs the native CPU kernels")
    torch.set_num_threads(1)  # as the pipeline runs a one-row decode (services/worker/threads.py)
    bs = engine.block_size
    blocks = -(-(args.context + 1) // bs)
    available = engine.kv.pool.shape[1] // bs
    if blocks > available:
        raise SystemExit(f"{args.context} tokens need {blocks} blocks; the pool has {available}")
    generator = torch.Generator().manual_seed(0)
    layouts = {
        "scattered": torch.randperm(available, generator=generator)[:blocks].tolist(),
        "in order": list(range(blocks)),
    }
    huge = engine.kv.pool
    plain = torch.empty(huge.shape, dtype=huge.dtype)  # torch's own allocation: 4 KB pages
    pools = {"huge pages": huge, "4 KB pages": plain}
    ids = [1] + [1000 + i % 30000 for i in range(args.context - 1)]
    print(f"{args.model}, one thread, {args.context} tokens of context, blocks of {bs}")
    print(f"{'layout':<10} {'pool':<11} {'step ms':>8} {'tok/s':>6}")
    rows = []
    for layout, table in layouts.items():
        engine.kv.pool = huge
        engine.step([SeqInput("d", ids, 0, table, sample=False)])  # the context's K/V
        plain.copy_(huge)
        logits = {}
        for name, pool in pools.items():
            engine.kv.pool = pool
            out = engine.step([SeqInput("d", [1000], args.context, table, sampling=GREEDY)])[0]
            logits[name] = (out.token_id, out.logprob)
        medians: dict[str, list[float]] = {name: [] for name in pools}
        for r in range(args.rounds):
            for name in pools if r % 2 == 0 else reversed(pools):
                engine.kv.pool = pools[name]
                medians[name].append(statistics.median(decode_steps(engine, args.context, table,
                                                                    args.steps)))  # fmt: skip
        same = len(set(logits.values())) == 1
        for name in pools:
            step = min(medians[name])
            print(f"{layout:<10} {name:<11} {step * 1e3:>8.2f} {1 / step:>6.1f}", flush=True)
            rounds = [m * 1e3 for m in medians[name]]
            rows.append({"layout": layout, "pool": name, "step_ms": step * 1e3,
                         "rounds_ms": rounds, "same_logits": same})  # fmt: skip
        if not same:
            print(f"  the pools' logits differ: {logits}")
        engine.release(["d"])
    engine.kv.pool = huge
    write_json(
        args.json, {"model": args.model, "context": args.context, "block_size": bs, "rows": rows}
    )


if __name__ == "__main__":
    main()
