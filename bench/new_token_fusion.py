"""Decode-step graphs with RoPE and the new token's K/V store inside the paged attention kernel
(`PagedDecode.attend_new`, the default) against a RoPE + store kernel before attention, in one
engine: each many-row bucket captured both ways in turn, twice, its replays timed with CUDA
events on the same inputs (every sequence at --context tokens). Also checks that the two give
the same logits, bit for bit.

    python -m bench.new_token_fusion [--model llama3-8b-random] [--rows 8 64 256] [--json PATH]
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this module as: python -m bench.new_token_fusion")

import argparse
from typing import Any

import torch

from bench.cli import first_paragraph, json_option, tandem_home, write_json
from bench.gpu_measure import random_prompt, timed
from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine

VARIANTS = {True: "in attention", False: "RoPE + store kernel"}


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--model", default="llama3-8b-random", help="a model name or path")
    parser.add_argument("--context", type=int, default=640, help="tokens each sequence holds")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256],
                        help="graph sizes (buckets) to compare")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="each variant in turn, this often")
    json_option(parser, "new_token_fusion.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.new_token_fusion times CUDA graphs: it needs a CUDA GPU")
    home = tandem_home()
    engine = Engine.from_path(
        registry.resolve(args.model, home), "cuda", "bfloat16", kv_cache_bytes=48 << 30,
        progress=False, max_num_seqs=max(args.rows), warm_up_tokens=None,
    )  # fmt: skip
    graphs = engine.graphs
    assert graphs is not None
    blocks = -(-(args.context + 8) // engine.block_size)
    vocab = engine.config.vocab_size
    seqs = [(f"s{i}", list(range(i * blocks, (i + 1) * blocks))) for i in range(max(args.rows))]
    for first in range(0, len(seqs), 8):  # prefill in groups: bounded activations
        group = enumerate(seqs[first : first + 8], start=first)
        prompts = [SeqInput(s, random_prompt(args.context, vocab, i), 0, t) for i, (s, t) in group]
        engine.step(prompts)
    print(f"{torch.cuda.get_device_name()}, {args.model}, {args.context} tokens a sequence")
    print(f"{'rows':>5} {'variant':<20} {'ms a step (rounds)':>24} {'tok/s':>8}")
    results: list[dict[str, Any]] = []
    for n in args.rows:
        if graphs.bucket(n) != n:
            raise SystemExit(f"{n} rows is not a graph size; sizes: {graphs.buckets}")
        # The graph's inputs: the first n sequences' next position (each step rewrites it).
        engine.step([SeqInput(s, [1], args.context, t) for s, t in seqs[:n]])
        engine._ahead = None  # a replay made ahead of a step nobody will ask for
        times: dict[bool, list[float]] = {True: [], False: []}
        logits = {}
        for _ in range(args.rounds):
            for fused in VARIANTS:
                graphs.fuse_new_tokens = fused
                graphs.recapture(n)
                graph, outputs = graphs.graphs[n]
                times[fused].append(timed(graph.replay, 30))
                logits[fused] = outputs.logits[:n].clone()
        graphs.fuse_new_tokens = True
        graphs.recapture(n)
        same = torch.equal(logits[True], logits[False])
        for fused, label in VARIANTS.items():
            ms = [t * 1e3 for t in times[fused]]
            best = min(ms)
            rounds = " / ".join(f"{t:.3f}" for t in ms)
            print(f"{n:>5} {label:<20} {rounds:>24} {n / best * 1e3:>8.0f}")
            results.append({"rows": n, "in_attention": fused, "ms_a_step": ms})
        gain = min(times[True]) / min(times[False]) - 1
        print(f"{n:>5} in attention: {gain:+.1%} a step; logits {'equal' if same else 'DIFFER'}")
        results.append({"rows": n, "step_change": gain, "logits_equal": same})
    write_json(args.json, {"context": args.context, "results": results})


if __name__ == "__main__":
    main()
