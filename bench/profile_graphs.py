"""Where a decode step's GPU time goes in the CUDA graphs serving replays, kernel by kernel.

    python -m bench.profile_graphs [--model llama3-8b-random] [--context 512] [--rows 64 256]

Batch 1 (bf16 weights, then int8): the one-row graph kernel by kernel. With programmatic
dependent launch a kernel starts before the one before it ends, so its own span overstates what
it adds to the step: each is charged from the end of the kernel before it to its own end. The
medians over the layers of QKV, attention, O, gate/up and down are printed beside each one's
floor (the bytes it must read, at a copy's rate). Many rows: the graphs of --rows sequences at
--context tokens, GPU time by kind of kernel. bench/profile_gpu.py profiles eager steps,
prefills and mixed steps. A diagnostic: bench/gpu.py has the speeds.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this module as: python -m bench.profile_graphs")

import argparse
import gc
import itertools
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.cli import first_paragraph, json_option, tandem_home, write_json
from bench.gpu_measure import copy_bandwidth, random_prompt
from bench.profile_gpu import kind_of
from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine

Span = tuple[str, float, float]  # a kernel's name, start and end (µs)
# A layer of the one-row step, by position from its attention kernel.
LAYER = (("QKV", -1), ("attention", 0), ("O", 1), ("gate/up", 2), ("down", 3))
ANCHOR = "_rope_attention"


def kernel_spans(replay: Callable[[], None], repeats: int) -> list[Span]:
    """The GPU kernels of `repeats` calls of `replay`, in the order they started."""
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in events]
    return sorted(spans, key=lambda s: s[1])


def charged_by_layer(spans: Sequence[Span]) -> dict[str, dict[str, list[float]]]:
    """For each layer's kernels (found by the attention kernel's name): the µs each adds to the
    step, from the end of the kernel before it (or its own start, after a gap) to its own end,
    and its own span. Layers without a kernel before QKV or four after attention are skipped."""
    charged: dict[str, list[float]] = {label: [] for label, _ in LAYER}
    own: dict[str, list[float]] = {label: [] for label, _ in LAYER}
    for i, (name, _, _) in enumerate(spans):
        if ANCHOR not in name or i < 2 or i + 3 >= len(spans):
            continue
        for label, offset in LAYER:
            _, start, end = spans[i + offset]
            before = spans[i + offset - 1][2]
            charged[label].append(end - max(before, start))
            own[label].append(end - start)
    return {"charged": charged, "span": own}


def medians(values: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in values.items() if v}


def floors_us(engine: Engine, context: int, copy: float) -> dict[str, float]:
    """A layer's kernels' floors: their weights' bytes (scales included), and attention's K/V."""
    block = engine.model.blocks()[0]
    modules = {
        "QKV": block.attention.wqkv,
        "O": block.attention.wo,
        "gate/up": block.feed_forward.w13,
        "down": block.feed_forward.w2,
    }
    out = {}
    for label, module in modules.items():
        tensors = itertools.chain(module.parameters(), module.buffers())
        out[label] = sum(t.numel() * t.element_size() for t in tensors) / copy * 1e6
    pool = engine.kv.pool
    kv_bytes = context * 2 * engine.config.kv_dim * pool.element_size()
    out["attention"] = kv_bytes / copy * 1e6
    return out


def batch1(path: Path, quantize: str, context: int, copy: float, repeats: int) -> dict[str, Any]:
    engine = Engine.from_path(
        path, "cuda", "bfloat16", kv_cache_bytes=2 << 30, progress=False, max_num_seqs=1,
        quantize=quantize, warm_up_tokens=None,
    )  # fmt: skip
    if engine.graphs is None or 1 not in engine.graphs.graphs:
        raise SystemExit("no one-row CUDA graph was captured")
    table = list(range(-(-(context + 8) // engine.block_size)))
    engine.step([SeqInput("p", random_prompt(context, engine.config.vocab_size, 3), 0, table)])
    engine.step([SeqInput("p", [1], context, table)])  # the graph's inputs now hold this step
    engine._ahead = None  # a replay made ahead of a step nobody will ask for
    graph, _ = engine.graphs.graphs[1]
    spans = kernel_spans(graph.replay, repeats)
    layers = charged_by_layer(spans)
    result = {
        "step_us": (spans[-1][2] - spans[0][1]) / repeats,
        "kernels_a_step": len(spans) / repeats,
        "charged_us": medians(layers["charged"]),
        "span_us": medians(layers["span"]),
        "floor_us": floors_us(engine, context, copy),
    }
    del engine, graph
    gc.collect()
    torch.cuda.empty_cache()
    return result


def many_rows(path: Path, rows: list[int], context: int, repeats: int) -> dict[int, dict[str, Any]]:
    engine = Engine.from_path(
        path, "cuda", "bfloat16", kv_cache_bytes=48 << 30, progress=False,
        max_num_seqs=max(rows), warm_up_tokens=None,
    )  # fmt: skip
    assert engine.graphs is not None
    results = {}
    blocks = -(-(context + 8) // engine.block_size)
    for n in rows:
        bucket = engine.graphs.bucket(n)
        if bucket != n:
            raise SystemExit(f"{n} rows is not a graph size; sizes: {engine.graphs.buckets}")
        seqs = [(f"s{i}", list(range(i * blocks, (i + 1) * blocks))) for i in range(n)]
        vocab = engine.config.vocab_size
        for first in range(0, n, 8):  # prefill in groups: bounded activations
            group = enumerate(seqs[first : first + 8], start=first)
            prompts = [SeqInput(s, random_prompt(context, vocab, i), 0, t) for i, (s, t) in group]
            engine.step(prompts)
        engine.step([SeqInput(s, [1], context, t) for s, t in seqs])
        engine._ahead = None
        spans = kernel_spans(engine.graphs.graphs[n][0].replay, repeats)
        kinds: dict[str, float] = {}
        for name, start, end in spans:
            kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + (end - start) / repeats
        results[n] = {"step_us": (spans[-1][2] - spans[0][1]) / repeats, "by_kind_us": kinds}
        engine.release(s for s, _ in seqs)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--model", default="llama3-8b-random", help="a model name or path")
    parser.add_argument("--context", type=int, default=512, help="tokens each sequence holds")
    parser.add_argument("--rows", type=int, nargs="*", default=[64, 256],
                        help="many-row graph sizes to profile (none: batch 1 only)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="graph replays profiled")
    json_option(parser, "profile_graphs.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.profile_graphs profiles CUDA graphs: it needs a CUDA GPU")
    home = tandem_home()
    path = registry.resolve(args.model, home)
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {copy / 1e12:.2f} TB/s, context {args.context}")
    print("(profiled with torch's profiler, each case one engine; medians over the layers)")
    results: dict[str, Any] = {"copy_bytes_per_s": copy, "context": args.context}
    for quantize in ("none", "int8"):
        got = batch1(path, quantize, args.context, copy, args.repeats)
        results[f"batch1_{quantize}"] = got
        name = "bf16" if quantize == "none" else quantize
        step, kernels = got["step_us"], got["kernels_a_step"]
        print(f"\nbatch 1, {name}: {step:.0f} µs a step, {kernels:.0f} kernels")
        print(f"{'kernel':<10} {'charged µs':>11} {'own span µs':>12} {'floor µs':>9}")
        for label, _ in LAYER:
            charged, span = got["charged_us"].get(label, 0.0), got["span_us"].get(label, 0.0)
            print(f"{label:<10} {charged:>11.1f} {span:>12.1f} {got['floor_us'][label]:>9.1f}")
    if args.rows:
        for n, got in many_rows(path, args.rows, args.context, args.repeats).items():
            results[f"decode_{n}"] = got
            kinds = "  ".join(
                f"{k} {v:.0f}" for k, v in sorted(got["by_kind_us"].items(), key=lambda kv: -kv[1])
            )
            print(f"\n{n} rows: {got['step_us']:.0f} µs a step; by kind (µs): {kinds}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
