"""Weight-only int8 matmul for small batches (Triton): y = (x @ W^T) * scale, W int8 per row.

Decode is bound by reading weights; int8 halves the bytes of bf16. The int8 tile is widened to
the activation dtype in registers and fed to the tensor cores, and the per-output-channel scale
is applied once at the end. Larger batches (prefill) are bound by arithmetic instead: there the
weight is widened once and cuBLAS does the product (see quant.Int8Linear).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SMALL_M = 64  # up to this many rows the kernel beats widening the weight for cuBLAS


@triton.jit
def _w8a16(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_om,
    K: tl.constexpr,  # a layer's width: fixed, and a compile-time loop bound
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )  # (BM, BK)
        w = tl.load(
            w_ptr + rn[:, None] * stride_wn + kk[None, :],
            mask=(rn[:, None] < N) & (kk[None, :] < K),
            other=0,
        )  # (BN, BK) int8
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    out = acc * scale[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


# Tile shapes tried once per (N, K, BM) on the GPU; the fastest is kept.
_tuned = triton.autotune(
    configs=[
        triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in [
            (16, 256, 4, 4),
            (32, 256, 4, 4),
            (64, 128, 4, 4),
            (32, 512, 8, 3),
            (64, 256, 8, 3),
        ]
    ],
    key=["N", "K", "BM"],
)(_w8a16)


def w8a16_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, tiles: tuple[int, int] | None = None
) -> torch.Tensor:
    """x: (M, K) bf16/fp16; weight: (N, K) int8; scale: (N,). Returns (M, N) in x's dtype.
    `tiles` (BN, BK) skips autotuning (Triton's CPU interpreter cannot time configs)."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    args = (x, weight, scale, out, m, n, x.stride(0), weight.stride(0), out.stride(0))
    if tiles is not None:
        bn, bk = tiles
        _w8a16[(triton.cdiv(n, bn), triton.cdiv(m, bm))](*args, K=k, BM=bm, BN=bn, BK=bk)
        return out

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return (triton.cdiv(n, meta["BN"]), triton.cdiv(m, bm))

    _tuned[grid](*args, K=k, BM=bm)
    return out
