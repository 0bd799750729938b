"""Matrix-vector products for one-row decode steps (Triton), with their input's producer fused in
front: y = W @ prologue(x), W in the activations' dtype (bf16/fp16) or int8 with a scale per row.

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

Int8 weights are read as 32-bit words of four and widened without a conversion instruction
(int8 → float conversions, and this widening feeding the tensor cores through shared memory,
both measured slower on an H200): one byte permute places each byte u = q + 128 (its sign bit
flipped) as the second byte of 1.0's bits, the float 1 + u / 2**15, which multiplies the input
directly. Since Σ (1 + u / 2**15) a = Σ a + (Σ q a + 128 Σ a) / 2**15, the kernel also sums the
inputs and recovers Σ q a at the end, then applies the row's scale. The cancellation costs
precision: 1e-4 relative to the largest output or less, against bf16's 4e-3 rounding. Even so the
arithmetic, not the memory, sets the pace for int8: 2.2-3.9 TB/s of int8 weights at the
LLaMA-3-8B shapes. (Triton's CPU interpreter cannot run the inline PTX; there shifts and masks
build the same bits.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PLAIN, ADD_NORM, SILU_MUL = 0, 1, 2
_SIGN_BITS: tl.constexpr = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32: sign bits
_ONE: tl.constexpr = tl.constexpr(0x3F800000)  # the float 1.0; its two low bytes are zero


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
def _int8_product(
    acc, sums, words, x_ptr, res_ptr, g_ptr, k0, rstd, K: tl.constexpr,
    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """acc + Σ over each word's four weights of (1 + (q + 128) / 2**15) * a, for the
    (BN, BK / 4) words of int8 weights at k0; sums + the inputs, four by four."""
    cols = tl.arange(0, BK // 4)
    flipped = words ^ _SIGN_BITS  # each byte now u = q + 128, in [1, 255]
    for byte in tl.static_range(4):
        kk = k0 + 4 * cols + byte
        a = _activation(x_ptr, res_ptr, g_ptr, kk, kk < K, rstd, K, PROLOGUE, HAS_RES)
        # The float 1 + u / 2**15: the byte u as the second byte of 1.0's bits.
        if ASM:  # one byte permute: 0x00, u, then 1.0's 0x80 and 0x3F
            bits = tl.inline_asm_elementwise(
                "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                [flipped, tl.full(words.shape, _ONE, tl.int32),
                 tl.full(words.shape, 0x7604 + 16 * byte, tl.int32)],
                dtype=tl.int32, is_pure=True, pack=1,
            )  # fmt: skip
        else:
            bits = (((flipped >> (8 * byte)) & 0xFF) << 8) | _ONE
        acc += bits.to(tl.float32, bitcast=True) * a[None, :]
        sums += a
    return acc, sums


@triton.jit
def _row_gemv(
    x_ptr, res_ptr, g_ptr, w_ptr, s_ptr, out_ptr, res_out_ptr, N, eps,
    K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, INT8: tl.constexpr, ASM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    nmask = rn < N
    # A row of w is K weights, or K / 4 words of four int8 weights; a tile BK weights wide.
    PER: tl.constexpr = 4 if INT8 else 1
    KW: tl.constexpr = K // PER
    cols = tl.arange(0, BK // PER)
    rows = w_ptr + rn.to(tl.int64)[:, None] * KW
    first = tl.load(rows + cols[None, :], mask=nmask[:, None] & (cols[None, :] < KW), other=0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's outputs are complete from here on
        tl.extra.cuda.gdc_launch_dependents()
    rstd = 1.0
    if PROLOGUE == 1:
        rk = tl.arange(0, BK)
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
    if INT8:
        acc = tl.zeros([BN, BK // 4], tl.float32)  # summed over the tile's width at the end
        sums = tl.zeros([BK // 4], tl.float32)
        acc, sums = _int8_product(
            acc, sums, first, x_ptr, res_ptr, g_ptr, 0, rstd, K, PROLOGUE, HAS_RES, BK, ASM
        )
        for k0 in range(BK, K, BK):
            wk = k0 // 4 + cols
            w = tl.load(rows + wk[None, :], mask=nmask[:, None] & (wk[None, :] < KW), other=0)
            acc, sums = _int8_product(
                acc, sums, w, x_ptr, res_ptr, g_ptr, k0, rstd, K, PROLOGUE, HAS_RES, BK, ASM
            )
        # Σ (1 + u/2**15) a = Σ a + (Σ q a + 128 Σ a) / 2**15: Σ q a is what follows.
        total = tl.sum(sums, 0)
        y = 32768.0 * (tl.sum(acc, 1) - total) - 128.0 * total
        y *= tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    else:
        rk = tl.arange(0, BK)
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


def _tile(n: int, k: int, weight_bytes: int) -> tuple[int, int, int]:
    """(BN, BK, warps) for an N × K product, as measured on an H200 at the LLaMA-3-8B shapes.

    bf16: 4 rows a program, 8 warps, and wide loads (4,096 inputs; 2,048 for the 4,096-row
    products, whose 1,024 programs are few enough already) keep enough bytes in flight. Int8,
    whose widening is arithmetic: more rows a program share each input, with 4 warps and
    narrower loads; the best of 10 tiles for each shape."""
    if weight_bytes == 1:
        if k > 4096:
            return 8, 2048, 8
        return (32, 512, 4) if n > 65536 else (16, 1024, 4)
    return 4, min(2048 if n <= 4096 else 4096, triton.next_power_of_2(k)), 8


def row_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
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

    x: (1, K), or (1, 2K) gate then up for SILU_MUL; weight: (N, K) in x's dtype, or int8 with
    `scale` (N,) (w = q * scale per row; K a multiple of 4). ADD_NORM: the input is
    rms_norm(x + residual) * norm_weight (residual may be None), and the second result is
    x + residual; otherwise the second result is x. Returns ((1, N) in out_dtype, default x's
    dtype; the stream (1, K))."""
    n, k = weight.shape
    assert x.shape[0] == 1 and x.is_contiguous() and weight.is_contiguous()
    int8 = scale is not None
    assert weight.dtype == (torch.int8 if int8 else x.dtype)
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k)
    has_res = prologue == ADD_NORM and residual is not None
    out = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    stream = torch.empty_like(x) if has_res else x
    bn, bk, warps = tile or _tile(n, k, weight.element_size())
    if int8:
        assert k % 4 == 0 and bk % 4 == 0
        weight = weight.view(torch.int32)  # words of four weights, read 32 bits at a time
    _row_gemv[(triton.cdiv(n, bn),)](
        x, residual if has_res else x, norm_weight if norm_weight is not None else x,
        weight, scale if int8 else x, out, stream, n, eps, K=k, PROLOGUE=prologue,
        HAS_RES=has_res, BN=bn, BK=bk, INT8=int8, ASM=x.is_cuda, PDL=pdl,
        num_warps=warps, launch_pdl=pdl,
    )  # fmt: skip
    return out, stream
