"""Where FP8 weights should switch from the weight-only kernel to the FP8 GEMM: one projection
of the LLaMA-3-8B shapes at 1-256 rows, each way, beside bf16's cuBLAS product (CUDA).

    python -m bench.fp8_linear [--json PATH]

Weight-only: `w8a16_matmul` reading e4m3 bytes (bound by reading the weights). FP8 GEMM: each
row scaled into e4m3 (`rows_to_fp8`), then `torch._scaled_mm` with row-wise scales. Times are
CUDA-event means of 50 calls after a warm-up that also autotunes. Prints a table, writes JSON.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this benchmark as a module: python -m bench.fp8_linear")

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.gpu_measure import timed
from engine.kernels.fp8_rows import rows_to_fp8
from engine.kernels.w8a16 import w8a16_matmul
from engine.quant import Fp8Linear

# (name, N out, K in) of the 8B model's fused projections.
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256]


def measure(layer: Fp8Linear, dense: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """Microseconds of one product of x each way."""

    def gemm() -> torch.Tensor:
        codes, scale_a = rows_to_fp8(x)
        return torch._scaled_mm(
            codes, layer.weight.t(), scale_a=scale_a, scale_b=layer.scale[None, :],
            out_dtype=torch.bfloat16,
        )  # fmt: skip

    return {
        "bf16_us": timed(lambda: F.linear(x, dense), 50) * 1e6,
        "weight_only_us": timed(lambda: w8a16_matmul(x, layer.weight, layer.scale), 50) * 1e6,
        "fp8_gemm_us": timed(gemm, 50) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = args.json or Path(os.environ.get("OUT", "bench")) / "RESULTS-fp8-linear.json"
    torch.manual_seed(0)
    rows = []
    print(f"{'shape':<8} {'rows':>5} {'bf16 µs':>9} {'weight-only µs':>15} {'fp8 GEMM µs':>12}")
    for name, n, k in SHAPES:
        layer = Fp8Linear(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ROWS:
            times = measure(layer, dense, torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            rows.append({"shape": name, "n": n, "k": k, "rows": m, **times})
            print(
                f"{name:<8} {m:>5} {times['bf16_us']:>9.1f} {times['weight_only_us']:>15.1f} "
                f"{times['fp8_gemm_us']:>12.1f}",
                flush=True,
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
