"""Weight-only int8 matmul for small batches (Triton): y = (x @ W^T) * scale, W int8 per row.

Decode is bound by reading weights; int8 halves the bytes of bf16. The int8 tile is widened to
the activation dtype in registers and fed to the tensor cores, and the per-output-channel scale
is applied once at the end. Larger batches (prefill) are bound by arithmetic instead: there the
weight is widened once and cuBLAS does the product (see quant.Int8Linear).

A 4096-row projection read 32 rows per program gives the GPU only 128 programs, each walking all
of K: too few loads in flight to reach the memory's bandwidth. Up to 16 rows the kernel may
split K too (SPLIT_K programs per output tile, chosen by autotuning): each writes its fp32
partial sum to a workspace and bumps the tile's counter; the last to arrive adds the partials,
scales, stores the tile and resets the counter, so a split product is still one launch.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

SMALL_M = 64  # up to this many rows the kernel beats widening the weight for cuBLAS
FP8_SMALL_M = 16  # up to this many rows it beats the FP8 GEMM (bench/fp8_small_m.py)


@triton.jit
def _w8a16(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    partial_ptr,  # (SPLIT_K, M, N) fp32 workspace; unused when SPLIT_K == 1
    counter_ptr,  # one int32 per output tile, zero between launches
    M,
    N,
    stride_xm,
    stride_wn,
    stride_om,
    K: tl.constexpr,  # a layer's width: fixed, and a compile-time loop bound
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FP8: tl.constexpr,  # the weight's bytes are e4m3 values, not int8 ones
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_per_split: tl.constexpr = K // SPLIT_K  # the launcher makes it a multiple of BK
    for k0 in range(0, k_per_split, BK):
        kk = pid_k * k_per_split + k0 + rk
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
        if FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tile_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K > 1:
        tl.store(partial_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=tile_mask)
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last partial of this tile: reduce it
            rs = tl.arange(0, SPLIT_K)
            parts = tl.load(
                partial_ptr + (rs[:, None, None] * M + rm[None, :, None]) * N + rn[None, None, :],
                mask=tile_mask[None, :, :],
                other=0.0,
                cache_modifier=".cg",  # written by other SMs: not through this one's L1
            )
            acc = tl.sum(parts, axis=0)
            tl.atomic_xchg(counter_ptr + tile, 0)
            _store_scaled(acc, s_ptr, out_ptr, rm, rn, M, N, stride_om)
    else:
        _store_scaled(acc, s_ptr, out_ptr, rm, rn, M, N, stride_om)


@triton.jit
def _store_scaled(acc, s_ptr, out_ptr, rm, rn, M, N, stride_om):
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    out = acc * scale[None, :]
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def _configs(tiles: list[tuple[int, int, int, int, int]]) -> list[triton.Config]:
    return [
        triton.Config({"BN": bn, "BK": bk, "SPLIT_K": split}, num_warps=w, num_stages=s)
        for bn, bk, split, w, s in tiles
    ]


_WHOLE_K = [
    (16, 256, 1, 4, 4),
    (32, 256, 1, 4, 4),
    (64, 128, 1, 4, 4),
    (32, 512, 1, 8, 3),
    (64, 256, 1, 8, 3),
]
# Tile shapes tried once per (N, K, BM) on the GPU; the fastest is kept. Split-K only up to 16
# rows, where the workspace stays small.
_tuned = triton.autotune(configs=_configs(_WHOLE_K), key=["N", "K", "BM", "FP8"])(_w8a16)
MAX_SPLIT_K = 8


def _whole_chunks(
    configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
) -> list[triton.Config]:
    """Only splits that cut K into whole BK-wide chunks (an unsplit K may end in a partial one)."""
    k = kwargs.get("K", named_args.get("K"))
    split = [c for c in configs if c.kwargs["SPLIT_K"] > 1]
    return [c for c in configs if c not in split or k % (c.kwargs["SPLIT_K"] * c.kwargs["BK"]) == 0]


_tuned_split = triton.autotune(
    configs=_configs(
        [
            *_WHOLE_K,
            (32, 256, 2, 4, 4),
            (32, 256, 4, 4, 4),
            (16, 256, 4, 4, 4),
            (32, 256, 8, 4, 4),
            (64, 256, 4, 8, 3),
            (32, 512, 2, 8, 3),
        ]
    ),
    key=["N", "K", "BM", "FP8"],
    prune_configs_by={"early_config_prune": _whole_chunks},
)(_w8a16)
_counters: dict[torch.device, torch.Tensor] = {}


def w8a16_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    tiles: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """x: (M, K) bf16/fp16; weight: (N, K) int8 or float8_e4m3fn; scale: (N,). Returns (M, N) in
    x's dtype.
    `tiles` (BN, BK[, SPLIT_K]) skips autotuning (Triton's CPU interpreter cannot time configs);
    a split must cut K into whole BK-wide chunks."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    split = bm == 16
    counters = _counters.get(x.device)
    if counters is None:  # allocated once, outside any CUDA graph capture (warm-up runs first)
        counters = _counters[x.device] = torch.zeros(1 << 16, dtype=torch.int32, device=x.device)
    partials = torch.empty((MAX_SPLIT_K if split else 1, m, n), device=x.device)
    strides = (x.stride(0), weight.stride(0), out.stride(0))
    fp8 = weight.dtype == torch.float8_e4m3fn
    # An fp8 weight is read as its bytes (masked lanes load 0, which an fp8 load cannot be
    # given) and reinterpreted in registers.
    bits = weight.view(torch.int8) if fp8 else weight
    args = (x, bits, scale, out, partials, counters, m, n, *strides)
    if tiles is not None:
        bn, bk, *rest = tiles
        split_k = rest[0] if rest else 1
        grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split_k)
        _w8a16[grid](*args, K=k, BM=bm, BN=bn, BK=bk, SPLIT_K=split_k, FP8=fp8)
        return out

    def tuned_grid(meta: dict[str, int]) -> tuple[int, int, int]:
        return (triton.cdiv(n, meta["BN"]), triton.cdiv(m, bm), meta["SPLIT_K"])

    (_tuned_split if split else _tuned)[tuned_grid](*args, K=k, BM=bm, FP8=fp8)
    return out
