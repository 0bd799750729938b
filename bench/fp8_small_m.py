"""Where an FP8 product of a few rows should leave the weight-only kernel (engine/kernels/w8a16.py)
for the FP8 GEMM (rows scaled into e4m3 by engine/kernels/fp8_rows.py, then torch._scaled_mm):
both paths at each row count and LLaMA-3-8B shape, timed inside CUDA graphs past the L2 cache as
bench/row_tiles.py times them.

    python -m bench.fp8_small_m [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch

from bench.cli import first_paragraph, json_option, write_json
from bench.row_tiles import DIM, FFN, L2_PASS, QKV, graph_seconds
from engine.kernels.fp8_rows import rows_to_fp8
from engine.kernels.w8a16 import FP8_SMALL_M, w8a16_matmul

SHAPES = {"qkv": (QKV, DIM), "o": (DIM, DIM), "gate/up": (2 * FFN, DIM), "down": (DIM, FFN)}
ROWS = [2, 8, 16, 24, 32, 48, 64, 96, 128]


def gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """As engine/quant.Fp8Linear beyond FP8_SMALL_M rows."""
    codes, row_scale = rows_to_fp8(x)
    return torch._scaled_mm(
        codes, w.t(), scale_a=row_scale, scale_b=scale[None, :], out_dtype=torch.bfloat16
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    json_option(parser, "fp8_small_m.json")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}; FP8_SMALL_M = {FP8_SMALL_M} today")
    print(f"{'shape':<8} {'rows':>5} {'weight-only µs':>15} {'FP8 GEMM µs':>12} {'faster':>10}")
    rows: list[dict[str, Any]] = []
    for name, m in itertools.product(SHAPES, ROWS):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device="cuda") * 64).to(torch.float8_e4m3fn)
        scale = torch.rand(n, device="cuda") / 64 + 1e-3
        copies = [w] + [w.clone() for _ in range(L2_PASS // w.numel())]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        times = {
            path: graph_seconds([lambda c=c, f=fn, x=x, s=scale: f(x, c, s) for c in copies])
            for path, fn in (("weight-only", w8a16_matmul), ("fp8 gemm", gemm))
        }
        faster = min(times, key=times.__getitem__)
        print(
            f"{name:<8} {m:>5} {times['weight-only'] * 1e6:>15.1f} "
            f"{times['fp8 gemm'] * 1e6:>12.1f} {faster:>10}",
            flush=True,
        )
        rows.append(dict(shape=name, rows=m, **{f"{p}_s": t for p, t in times.items()}))
        del w, copies
    write_json(args.json, {"fp8_small_m": FP8_SMALL_M, "rows": rows})


if __name__ == "__main__":
    main()
