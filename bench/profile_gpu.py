"""Where a step's GPU time goes, by kind of kernel: matmuls, attention, the small fused
operations, sampling, the rest; for the steps serving runs.

    python -m bench.profile_gpu [--model llama3-8b-random] [--rows 10] [--json PATH]

Profiles eager steps with torch.profiler (bench/profile_graphs.py profiles the CUDA graphs): a
2,048-token prefill, a mixed step (whole prompts, a chunk that continues a prompt and decodes),
and decode steps of 1, 64 and 256 sequences at 640 tokens of context and of 16 at 4,096. The
KV pool holds random values (attention's cost does not depend on them). Prints each case's GPU
time by kind against its floor; the top kernels go to the JSON. A diagnostic, not a benchmark.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this module as: python -m bench.profile_gpu")

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

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


def profiled(engine: Engine, batch: list[SeqInput], repeats: int) -> tuple[float, dict[str, Any]]:
    """Wall seconds a step, and the GPU's µs a step by kind and by kernel."""
    engine.step(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            engine.step(batch)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / repeats
    kernels: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = evt.self_cuda_time_total
        if us > 0:
            kernels[evt.key] = kernels.get(evt.key, 0.0) + us / repeats
    kinds: dict[str, float] = {}
    for name, us in kernels.items():
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + us
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:25])
    return wall, {"kinds": kinds, "gpu_us": sum(kernels.values()), "top": top}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b-random")
    parser.add_argument(
        "--json", type=Path, default=Path(os.environ.get("OUT", "bench")) / "profile.json"
    )
    args = parser.parse_args()
    home = Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser()
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
    print(f"{'case':<40} {'wall us':>9} {'gpu us':>9} {'floor us':>9}  by kind (us, share)")
    for name, (batch, floor) in cases.items():
        wall, got = profiled(engine, batch, 3)
        engine.release(s.seq_id for s in batch)
        results[name] = {"wall_us": wall * 1e6, "floor_us": floor * 1e6, **got}
        kinds = "  ".join(
            f"{k} {v:.0f} ({v / got['gpu_us']:.0%})"
            for k, v in sorted(got["kinds"].items(), key=lambda kv: -kv[1])
        )
        print(f"{name:<40} {wall * 1e6:>9.0f} {got['gpu_us']:>9.0f} {floor * 1e6:>9.0f}  {kinds}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


def triton_ms(fn: Any) -> float:
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median")


def copy_rate() -> float:
    src = torch.empty(1 << 32, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (triton_ms(lambda: dst.copy_(src)) / 1e3)


if __name__ == "__main__":
    main()
