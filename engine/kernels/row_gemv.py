"""Matrix-vector products for one-row decode steps (Triton), with their input's producer fused in
front: y = W @ prologue(x), W in the activations' dtype (bf16/fp16).

At batch 1 a decode step is a chain of matrix-vector products whose bytes are all weights, and
between them small operations (residual add + RMSNorm, SiLU·up) that cost a launch each and
leave the memory idle. Here each product computes its own input: silu(gate) * up, or the add +
norm (every program first sums the row's squares, 2 × dim elements from L2, and program 0
writes the new residual stream). Rounding follows engine/kernels/fused.py step by step, so the
products see the very activations the unfused path would. (A version that saved the first pass,
summing squares along the product and scaling its result by rstd at the end, measured slower on
an H200.)

Launched with programmatic dependent launch (Hopper): a product's programs may start while the
previous kernel finishes, fetch their first weight tile (weights never depend on it), and only
then wait for it. The fetch and the previous kernel's tail overlap, and so do the launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PLAIN, ADD_NORM, SILU_MUL = 0, 1, 2


@triton.jit
def _activation(
    x_ptr, res_ptr, g_ptr, kk, km, rstd, K: tl.constexpr,
    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """The input chunk x[kk] after the prologue, in fp32."""
    dt = x_ptr.dtype.element_ty
    if PROLOGUE == 1:  # ADD_NORM
        s = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
        if HAS_RES:
            s += tl.load(res_ptr + kk, mask=km, other=0.0).to(tl.float32)
        normed = (s.to(dt).to(tl.float32) * rstd).to(dt)
        a = normed * tl.load(g_ptr + kk, mask=km, other=0.0)
    elif PROLOGUE == 2:  # SILU_MUL: x holds gate then up, K each
        gate = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + kk, mask=km, other=0.0).to(tl.float32)
        a = (gate / (1.0 + tl.exp(-gate)) * up).to(dt)
    else:
        a = tl.load(x_ptr + kk, mask=km, other=0.0)
    return a.to(tl.float32)


@triton.jit
def _row_gemv(
    x_ptr, res_ptr, g_ptr, w_ptr, out_ptr, res_out_ptr, N, eps,
    K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    nmask = rn < N
    rk = tl.arange(0, BK)
    rows = w_ptr + rn.to(tl.int64)[:, None] * K
    first = tl.load(rows + rk[None, :], mask=nmask[:, None] & (rk[None, :] < K), other=0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's outputs are complete from here on
        tl.extra.cuda.gdc_launch_dependents()
    rstd = 1.0
    if PROLOGUE == 1:
        squares = tl.zeros([BK], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            km = kk < K
            s = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
            if HAS_RES:
                s += tl.load(res_ptr + kk, mask=km, other=0.0).to(tl.float32)
            # The stream is kept in the model's dtype, and normalised as stored.
            stream = s.to(x_ptr.dtype.element_ty)
            if HAS_RES:  # noqa: SIM102 (a compile-time test, then a run-time one)
                if pid == 0:  # one program writes the new stream
                    tl.store(res_out_ptr + kk, stream, mask=km)
            sf = stream.to(tl.float32)
            squares += sf * sf
        rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)
    a = _activation(x_ptr, res_ptr, g_ptr, rk, rk < K, rstd, K, PROLOGUE, HAS_RES)
    acc = first.to(tl.float32) * a[None, :]  # (BN, BK), summed over K once at the end
    for k0 in range(BK, K, BK):
        kk = k0 + rk
        km = kk < K
        w = tl.load(rows + kk[None, :], mask=nmask[:, None] & km[None, :], other=0)
        a = _activation(x_ptr, res_ptr, g_ptr, kk, km, rstd, K, PROLOGUE, HAS_RES)
        acc += w.to(tl.float32) * a[None, :]
    y = tl.sum(acc, 1)
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=nmask)


def _tile(n: int, k: int) -> tuple[int, int, int]:
    """(BN, BK, warps) for an N × K product, as measured on an H200 at the LLaMA-3-8B shapes:
    4 rows a program, 8 warps, and wide loads (4,096 inputs; 2,048 for the 4,096-row products,
    whose 1,024 programs are few enough already) keep enough bytes in flight."""
    return 4, min(2048 if n <= 4096 else 4096, triton.next_power_of_2(k)), 8


def row_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    prologue: int = PLAIN,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    out_dtype: torch.dtype | None = None,
    pdl: bool = False,
    tile: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y = weight @ prologue(x) for one row x, and the residual stream after the prologue.

    x: (1, K), or (1, 2K) gate then up for SILU_MUL; weight: (N, K) in x's dtype. ADD_NORM: the
    input is rms_norm(x + residual) * norm_weight (residual may be None), and the second result
    is x + residual; otherwise the second result is x. Returns ((1, N) in out_dtype, default
    x's dtype; the stream (1, K))."""
    n, k = weight.shape
    assert x.shape[0] == 1 and x.is_contiguous() and weight.is_contiguous()
    assert weight.dtype == x.dtype
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k)
    has_res = prologue == ADD_NORM and residual is not None
    out = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    stream = torch.empty_like(x) if has_res else x
    bn, bk, warps = tile or _tile(n, k)
    _row_gemv[(triton.cdiv(n, bn),)](
        x, residual if has_res else x, norm_weight if norm_weight is not None else x,
        weight, out, stream, n, eps, K=k, PROLOGUE=prologue, HAS_RES=has_res,
        BN=bn, BK=bk, PDL=pdl, num_warps=warps, launch_pdl=pdl,
    )  # fmt: skip
    return out, stream
