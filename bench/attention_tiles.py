"""Paged decode attention (engine/kernels/paged_decode.py) over partition lengths and tilings:
GB/s of K/V read, against a device-to-device copy, at the batch sizes and contexts of serving,
for a bf16 and an fp8 (e4m3) KV pool.

    python -m bench.attention_tiles [--json PATH]

A diagnostic for choosing PagedDecode's defaults; prints the best variants of each case and the
current default's figure. Each kernel is timed inside a CUDA graph, as decode steps run it.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this module as: python -m bench.attention_tiles")

import argparse
import functools
import itertools

import torch
from triton.testing import do_bench, do_bench_cudagraph

from bench.cli import first_paragraph, json_option, write_json
from engine.kernels.paged_decode import PagedDecode, Tiling

HEADS, KV_HEADS, HEAD_DIM, BLOCK, MAX_CONTEXT = 32, 8, 128, 16, 8192
CASES = [(256, 640), (128, 640), (64, 640), (32, 640), (8, 640), (16, 4096)]
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    json_option(parser, "attention.json")
    args = parser.parse_args()
    cuda = torch.device("cuda")
    slots = sum(n * (-(-ctx // BLOCK)) for n, ctx in CASES) * BLOCK
    pool = torch.randn(slots, 2, KV_HEADS, HEAD_DIM, device=cuda, dtype=torch.bfloat16)
    pools = {name: pool.to(dtype) for name, dtype in KV_DTYPES.items()}
    src = torch.empty(1 << 30, dtype=torch.uint8, device=cuda)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / (do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3)
    print(f"copy {copy / 1e12:.2f} TB/s")
    inputs = {}
    order = torch.randperm(slots // BLOCK, device=cuda)
    used = 0
    for n, ctx in CASES:
        blocks = -(-ctx // BLOCK)
        tables = order[used : used + n * blocks].view(n, blocks).contiguous()
        used += n * blocks
        lens = torch.full((n,), ctx, device=cuda)
        q = torch.randn(n, HEADS, HEAD_DIM, device=cuda, dtype=torch.bfloat16)
        inputs[(n, ctx)] = (q, tables, lens)
    variants: list[tuple[int | None, Tiling | None]] = [(None, None)]  # the defaults
    for blocks, (tile, warps), stages in itertools.product(
        (8, 16, 64), ((32, 2), (64, 2), (64, 4), (128, 2), (128, 4), (128, 8)), (2, 3, 4)
    ):
        variants.append((blocks, Tiling(tile, warps, True, stages)))
    results = []
    for (kv, pool), (pb, tiling) in itertools.product(pools.items(), variants):
        kernel = PagedDecode(
            256, HEADS, KV_HEADS, HEAD_DIM, BLOCK, MAX_CONTEXT, cuda, pb, tiling, pool.dtype
        )
        for (n, ctx), (q, tables, lens) in inputs.items():
            if pb is not None and (n * KV_HEADS * (-(-ctx // (pb * BLOCK)))) < 32:
                continue  # too few programs to be a candidate
            call = functools.partial(kernel, q, pool, tables, lens)
            call()  # compile outside the graph
            ms = do_bench_cudagraph(call, rep=40, return_mode="median")
            gbs = n * ctx * 2 * KV_HEADS * HEAD_DIM * pool.element_size() / (ms / 1e3) / 1e9
            results.append(
                {
                    "kv": kv,
                    "batch": n,
                    "context": ctx,
                    "part_blocks": kernel.part_blocks(n),
                    "tiling": vars(kernel.tiling(n)),
                    "default": pb is None,
                    "us": ms * 1e3,
                    "gb_s": gbs,
                    "of_copy": gbs * 1e9 / copy,
                }
            )
    for kv, (n, ctx) in itertools.product(KV_DTYPES, CASES):
        case = [r for r in results if (r["kv"], r["batch"], r["context"]) == (kv, n, ctx)]
        default = next(r for r in case if r["default"])
        print(f"\n{kv} KV, batch {n}, context {ctx}: default {default['us']:.1f} us, "
              f"{default['gb_s']:.0f} GB/s ({default['of_copy']:.0%} of copy)")  # fmt: skip
        for r in sorted(case, key=lambda r: r["us"])[:6]:
            t = r["tiling"]
            print(
                f"  pb {r['part_blocks']:>2} tile {t['tile']:>2} warps {t['warps']} "
                f"stages {t['stages']}: {r['us']:7.1f} us {r['gb_s']:6.0f} GB/s "
                f"({r['of_copy']:.0%})"
            )
    write_json(args.json, {"copy_bytes_per_s": copy, "results": results})


if __name__ == "__main__":
    main()
