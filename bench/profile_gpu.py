"""Where a step's GPU time goes, by kind of kernel: matmuls, attention, the small fused
operations, sampling, the rest; for the steps serving runs.

    python -m bench.profile_gpu [--model llama3-8b-random] [--rows 10] [--json PATH]

Profiles eager steps with torch.profiler (bench/profile_graphs.py profiles the CUDA graphs): a
2,048-token prefill, a mixed step (whole prompts, a chunk that continues a prompt and decodes),
and decode steps of 1, 64 and 256 sequences at 640 tokens of context and of 16 at 4,096. The
KV pool holds random values (attention's cost does not depend on them). Prints each case's wall
time (unprofiled), the GPU's span from its first kernel to its last and the idle time within it,
and the kernels' time by kind against the case's floor; the top kernels go to the JSON. The
profiler slows the host's launches, so where the host sets the pace (eager decode steps) the
profiled span and idle time overstate the unprofiled step's. With --rest, the card idles that
many seconds before each step: a prompt to an idle server starts at the card's idle clocks.
A diagnostic, not a benchmark.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this module as: python -m bench.profile_gpu")

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.cli import first_paragraph, json_option, tandem_home, write_json
from bench.gpu_measure import prefill_params, weight_bytes
from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine

KINDS = {
    "matmul": ("gemm", "nvjet", "cutlass", "xmma", "cublas"),
    "attention": ("_partial", "_merge", "flash", "fmha", "attention", "_rope_attention"),
    "fused": ("_add_rms_norm", "_rope_store", "_silu_mul"),
    "sampling": ("argmax", "logsumexp", "softmax", "sort", "topk", "_greedy", "reduce"),
}


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS.items() if any(x in low for x in keys)), "other")


def ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def span_and_idle(intervals: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The GPU's (start, end) activity intervals of one step: the span from the first start to
    the last end, and the time within it that nothing ran (kernels may overlap: PDL)."""
    ordered = sorted(intervals)
    first, reached, idle = ordered[0][0], ordered[0][0], 0.0
    for start, end in ordered:
        idle += max(0.0, start - reached)
        reached = max(reached, end)
    return reached - first, idle


def profiled(
    engine: Engine, batch: list[SeqInput], repeats: int, rest: float = 0.0
) -> tuple[float, dict[str, Any]]:
    """Wall seconds a step (median, unprofiled), and a step's GPU µs: span, idle within it, by
    kind and by kernel. `rest`: idle seconds before each step."""
    engine.step(batch)
    walls, spans, idles = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        time.sleep(rest)
        start = time.perf_counter()
        engine.step(batch)  # returns with the step's tokens on the host
        walls.append(time.perf_counter() - start)
    kernels: dict[str, float] = {}
    for _ in range(repeats):  # one profile a step, so that its GPU span stands alone
        torch.cuda.synchronize()
        time.sleep(rest)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step(batch)
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        span, idle = span_and_idle([(e.time_range.start, e.time_range.end) for e in events])
        spans.append(span)
        idles.append(idle)
        for e in events:
            us = e.time_range.end - e.time_range.start
            kernels[e.name] = kernels.get(e.name, 0.0) + us / repeats
    kinds: dict[str, float] = {}
    for name, us in kernels.items():
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + us
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:25])
    return statistics.median(walls), {
        "kinds": kinds,
        "gpu_us": sum(kernels.values()),
        "span_us": statistics.median(spans),
        "idle_us": statistics.median(idles),
        "top": top,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--model", default="llama3-8b-random")
    json_option(parser, "profile.json")
    parser.add_argument(
        "--rest", type=float, default=0.0, help="idle seconds before each step (an idle card)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="steps timed and profiled a case")
    args = parser.parse_args()
    home = tandem_home()
    engine = Engine.from_path(
        registry.resolve(args.model, home),
        "cuda",
        "bfloat16",
        kv_cache_bytes=32 << 30,
        progress=False,
        max_num_seqs=256,
        cuda_graphs=False,
        warm_up_tokens=None,
    )
    c, bs = engine.config, engine.block_size
    engine.kv.pool.normal_()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flops = 2 * 8192**3 / (triton_ms(lambda: a @ a) / 1e3)
    copy = copy_rate()
    params, head = prefill_params(engine)
    wbytes = weight_bytes(engine)
    kv_token = 2 * c.n_layers * c.kv_dim * 2
    print(f"copy {copy / 1e12:.2f} TB/s, matmul {flops / 1e12:.0f} TFLOP/s")

    def table(n: int, ctx: int, first: int) -> list[int]:
        blocks = -(-(ctx + 1) // bs)
        return list(range(first * blocks, (first + 1) * blocks))

    cases: dict[str, tuple[list[SeqInput], float]] = {}
    prompt = ids(2048, c.vocab_size, 0)
    cases["prefill 2048"] = (
        [SeqInput("p", prompt, 0, table(1, 2048, 0))],
        (2 * params * 2048 + 2 * head) / flops,
    )
    mixed = [SeqInput(f"m{i}", ids(480, c.vocab_size, i), 0, table(1, 480, i)) for i in range(3)]
    mixed.append(SeqInput("c", ids(384, c.vocab_size, 9), 256, table(1, 640, 3), sample=False))
    mixed += [SeqInput(f"d{i}", [i], 640, table(1, 640, 4 + i)) for i in range(64)]
    # 1,888 tokens through the layers; 67 sampled rows (3 prompts, 64 decodes) through the head.
    cases["mixed: 3x480 + chunk 384 + 64 decodes"] = (
        mixed,
        2 * (params * 1888 + head * 67) / flops,
    )
    for n, ctx in ((1, 640), (64, 640), (256, 640), (16, 4096)):
        batch = [SeqInput(f"d{i}", [i], ctx, table(1, ctx, i)) for i in range(n)]
        cases[f"decode {n} x {ctx}"] = (batch, (wbytes + n * (ctx + 1) * kv_token) / copy)
    results = {}
    print(f"{'case':<40} {'wall us':>8} {'span us':>8} {'idle us':>8} {'gpu us':>8} "
          f"{'floor us':>8}  kernels by kind (us, share)")  # fmt: skip
    for name, (batch, floor) in cases.items():
        wall, got = profiled(engine, batch, args.repeats, args.rest)
        engine.release(s.seq_id for s in batch)
        results[name] = {"wall_us": wall * 1e6, "floor_us": floor * 1e6, **got}
        kinds = "  ".join(
            f"{k} {v:.0f} ({v / got['gpu_us']:.0%})"
            for k, v in sorted(got["kinds"].items(), key=lambda kv: -kv[1])
        )
        print(
            f"{name:<40} {wall * 1e6:>8.0f} {got['span_us']:>8.0f} {got['idle_us']:>8.0f} "
            f"{got['gpu_us']:>8.0f} {floor * 1e6:>8.0f}  {kinds}"
        )
    write_json(args.json, results)


def triton_ms(fn: Any) -> float:
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median")


def copy_rate() -> float:
    src = torch.empty(1 << 32, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (triton_ms(lambda: dst.copy_(src)) / 1e3)


if __name__ == "__main__":
    main()
