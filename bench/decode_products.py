"""A decode step's products at LLaMA-3-8B shapes and many rows (M = 16..256): cuBLAS, as the
model runs them (`F.linear`), beside every algorithm cuBLASLt's heuristic offers
(bench/cublaslt.py) and Triton tiles with split K, each timed inside CUDA graphs over copies
of the weight that pass through more than the L2 cache, as a decode step reads each weight
once. A row says the time, the share of the copy bandwidth its weight bytes reach, and the share
of the matmul rate its FLOPs reach; a table at the end sums a layer's four products by rows.

    python -m bench.decode_products [--rows 64,256] [--kernels cublas,lt,triton] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench import cublaslt
from bench.cli import first_paragraph, json_option, write_json
from bench.gpu_measure import copy_bandwidth, matmul_rate
from bench.row_tiles import L2_PASS, graph_seconds

DIM, FFN, QKV, VOCAB = 4096, 14336, 6144, 128256
SHAPES = {"qkv": (QKV, DIM), "o": (DIM, DIM), "gate/up": (2 * FFN, DIM), "down": (DIM, FFN)}
SHAPES["head"] = (VOCAB, DIM)


# (BM, BN, BK, split, warps, stages)
def tiles(m: int) -> list[tuple[int, ...]]:
    blocks = [64] if m <= 64 else [64, 128]
    return list(itertools.product(blocks, [64, 128], [64, 128], [1, 2, 4], [4], [4, 6]))


@triton.jit
def _products(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    K_SPLIT,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """out[s, m, n] = the sum over program s's K range of x[m, k] * w[n, k], in out's dtype:
    the product itself with one range, fp32 partials to be summed with several."""
    pid_n, pid_m, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k0 = s * K_SPLIT
    xs = x_ptr + rm[:, None] * K + (k0 + rk)[None, :]
    ws = w_ptr + rn[:, None] * K + (k0 + rk)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K_SPLIT, BK):
        x = tl.load(xs, mask=rm[:, None] < M, other=0.0)
        w = tl.load(ws)
        acc += tl.dot(x, tl.trans(w))
        xs += BK
        ws += BK
    out = out_ptr + s * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rm[:, None] < M)


def triton_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    partials: torch.Tensor,
    tile: tuple[int, ...],
) -> None:
    bm, bn, bk, split, warps, stages = tile
    m, k = x.shape
    n = w.shape[0]
    grid_m = triton.cdiv(m, bm)
    target = out if split == 1 else partials
    _products[(n // bn, grid_m, split)](
        x, w, target, m, n, k, k // split, bm, bn, bk, num_warps=warps, num_stages=stages
    )
    if split > 1:
        torch.sum(partials[:split], dim=0, out=out)  # fixed order: deterministic


def measure(
    name: str, m: int, bandwidth: float, rate: float, kernels: set[str]
) -> list[dict[str, Any]]:
    n, k = SHAPES[name]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    copies = [w] + [w.clone() for _ in range(L2_PASS // (w.numel() * 2))]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    partials = torch.empty(4, m, n, device="cuda", dtype=torch.float32)
    reference = F.linear(x, w)
    candidates: list[tuple[str, list[Any]]] = [
        ("cuBLAS F.linear", [lambda c=c: torch.nn.functional.linear(x, c, out=out) for c in copies])  # type: ignore[call-arg]
    ]
    if "lt" in kernels:
        for i, algo in enumerate(cublaslt.algorithms(m, n, k)):
            product = cublaslt.Product(m, n, k, algo)
            calls = [lambda c=c, p=product: p(x, c, out) for c in copies]
            candidates.append((f"cuBLASLt algorithm {i}", calls))
    for tile in tiles(m) if "triton" in kernels else []:
        if k % (tile[2] * tile[3]) or n % tile[1]:
            continue
        candidates.append(
            (
                f"triton {tile}",
                [lambda c=c, t=tile: triton_linear(x, c, out, partials, t) for c in copies],
            )
        )
    rows: list[dict[str, Any]] = []
    for label, calls in candidates:
        try:
            calls[0]()
            torch.cuda.synchronize()
            error = (out.float() - reference.float()).abs().max().item()
            seconds = graph_seconds(calls)
        except Exception as err:  # a tile this shape cannot take: say so, go on
            print(f"{name:<8} {m:>4} {label:<40} failed: {type(err).__name__}: {err}"[:200])
            continue
        of_copy = n * k * 2 / seconds / bandwidth
        of_rate = 2 * m * n * k / seconds / rate
        rows.append(
            dict(
                shape=name,
                rows=m,
                kernel=label,
                seconds=seconds,
                of_copy=of_copy,
                of_rate=of_rate,
                max_error=error,
            )
        )
    rows.sort(key=lambda r: r["seconds"])
    cublas = next(r for r in rows if r["kernel"].startswith("cuBLAS"))
    for r in rows[:3] + ([cublas] if cublas not in rows[:3] else []):
        print(
            f"{name:<8} {m:>4} {r['kernel']:<40} {r['seconds'] * 1e6:>8.1f} "
            f"{r['of_copy']:>8.1%} {r['of_rate']:>8.1%} {r['max_error']:>8.3f}",
            flush=True,
        )
    return rows


def summarize(rows: list[dict[str, Any]]) -> None:
    """A layer's four products (QKV, O, gate/up, down) by rows, µs: cuBLAS as torch runs it, the
    heuristic's first cuBLASLt algorithm, and the fastest of each product's candidates."""
    print(f"\n{'rows':>5} {'cuBLAS':>8} {'Lt first':>9} {'best':>8}  (a layer's products, µs)")
    layer = [name for name in SHAPES if name != "head"]
    for m in sorted({r["rows"] for r in rows}):
        by = {name: [r for r in rows if r["rows"] == m and r["shape"] == name] for name in layer}
        if not all(by.values()):
            continue

        def total(pick: Any, by: dict[str, list[dict[str, Any]]] = by) -> float:
            return sum(pick(by[name]) for name in layer) * 1e6

        def named(label: str) -> Any:
            return lambda rs: next((r["seconds"] for r in rs if r["kernel"] == label), float("nan"))

        def fastest_correct(rs: list[dict[str, Any]]) -> float:
            tolerance = 4 * next(r["max_error"] for r in rs if r["kernel"].startswith("cuBLAS "))
            return min(r["seconds"] for r in rs if r["max_error"] <= tolerance + 1e-3)

        best = total(fastest_correct)
        print(
            f"{m:>5} {total(named('cuBLAS F.linear')):>8.1f} "
            f"{total(named('cuBLASLt algorithm 0')):>9.1f} {best:>8.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--rows", default="16,64,128,256")
    parser.add_argument("--kernels", default="cublas,lt,triton", help="families to time")
    json_option(parser, "decode_products.json")
    args = parser.parse_args()
    bandwidth, rate = copy_bandwidth(), matmul_rate()
    print(
        f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, "
        f"bf16 matmul {rate / 1e12:.0f} TFLOP/s"
    )
    print(
        f"{'shape':<8} {'rows':>4} {'kernel':<40} {'µs':>8} {'of copy':>8} {'of rate':>8} "
        f"{'max err':>8}"
    )
    rows = []
    kernels = set(args.kernels.split(","))
    for m in map(int, args.rows.split(",")):
        for name in SHAPES:
            rows += measure(name, m, bandwidth, rate, kernels)
    summarize(rows)
    write_json(args.json, {"copy_bandwidth": bandwidth, "matmul_rate": rate, "rows": rows})


if __name__ == "__main__":
    main()
