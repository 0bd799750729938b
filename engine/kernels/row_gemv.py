"""Matrix-vector products for one-row decode steps (Triton), with the small operations between
them fused into their two ends: y = W @ prologue(x), W in the activations' dtype (bf16/fp16) or
int8 with a scale per row, and an epilogue that writes what the next product needs.

At batch 1 a decode step is a chain of matrix-vector products whose bytes are all weights, and
between them small operations (residual add + RMSNorm, SiLU·up) that cost a launch each and
leave the memory idle. Here a layer is four products:

    QKV      prologue NORM: rms_norm(stream) * g
    O        epilogue RESIDUAL: the new stream, stream + y, and its sum of squares
    gate/up  prologue NORM; epilogue SWIGLU: each program computes a gate row and its up row
             together and writes silu(gate) * up
    down     epilogue RESIDUAL

RESIDUAL writes one partial sum of squares a program; NORM sums those (a few KB, from L2) for
its rstd, so no program reads the whole stream twice, and SWIGLU leaves down a plain input: no
program recomputes SiLU over 14,336 inputs. (The first NORM of a step, on the embedding, sums
the squares itself.) Rounding follows model.py step by step (each product's output, the
stream, the normed input and silu(gate) * up are rounded to the model's dtype), so the products
see the very activations the unfused path would.

Launched with programmatic dependent launch (Hopper): a product's programs may start while the
previous kernel finishes, fetch their first weight tile (weights never depend on it), and only
then wait for it. The fetch and the previous kernel's tail overlap, and so do the launches.
Weights are read once a step, so their loads ask L2 to evict them first. (Streaming the
weights through shared memory instead, cp.async stages ahead across the wait, was slower on an
H200: bench/RESULTS-gpu.md, session 59.)

Int8 weights are read as 32-bit words of four, their four 16-bit inputs as one 64-bit word,
and the weights widened without a conversion instruction
(int8 → float conversions, and this widening feeding the tensor cores through shared memory,
were both slower; gate/up and the head, where this arithmetic costs most, have their own
kernel, row_gemv_tc.py, which widens to fp16 in registers for the tensor cores):
one byte permute places each byte u = q + 128 (its sign bit flipped) as the second byte of
1.0's bits, the float 1 + u / 2**15, which multiplies the input directly. Since
Σ (1 + u / 2**15) a = Σ a + (Σ q a + 128 Σ a) / 2**15, the kernel also sums the inputs and
recovers Σ q a at the end, then applies the row's scale. The cancellation costs
precision: 1e-4 relative to the largest output or less, against bf16's 4e-3 rounding. A permute
and an FMA a weight cost int8's small products a few points of the copy rate against the same
loads with no arithmetic, and int8 inputs with dp4a do no better (bench/int8_activations.py,
bench/RESULTS-gpu.md session 64). 1.0's bits arrive
as a kernel argument: as a literal, ptxas makes it the permute's immediate operand and rebuilds
the byte selector in a register before every permute, a quarter more instructions in the loop.
(Triton's CPU interpreter cannot run the inline PTX; there shifts and masks build the same
bits.)

FP8 (e4m3) weights, also with a scale per row, are read as bytes and widened by the hardware's
conversion (e4m3 pairs to fp16 pairs, then fp32): e4m3 has no linear bit trick like int8's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PLAIN, NORM = 0, 1  # the input: x, or rms_norm(x) * norm_weight
STORE, RESIDUAL, SWIGLU = 0, 1, 2  # the output: y; residual + y; silu(gate) * up
_SIGN_BITS: tl.constexpr = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32: sign bits
_ONE = 0x3F800000  # the float 1.0; its two low bytes are zero
# Byte BYTE of the word, between 1.0's bytes (0x00 u 0x80 0x3F from the low end).
_PERMUTES: tl.constexpr = tl.constexpr(
    tuple(f"prmt.b32 $0, $1, $2, {0x7604 + 16 * byte:#x};" for byte in range(4))
)


@triton.jit
def _within(i, n, EVEN: tl.constexpr):
    """i < n; where the tiles divide the product evenly, a constant the loads drop (unmasked
    tiles skip zeroing their registers and the comparisons)."""
    if EVEN:
        return tl.full(i.shape, 1, tl.int1)
    return i < n


@triton.jit
def _activation(x_ptr, g_ptr, kk, km, rstd, PROLOGUE: tl.constexpr):
    """The input chunk x[kk] after the prologue, in fp32."""
    if PROLOGUE == 1:  # NORM
        x = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
        a = (x * rstd).to(x_ptr.dtype.element_ty) * tl.load(g_ptr + kk, mask=km, other=0.0)
    else:
        a = tl.load(x_ptr + kk, mask=km, other=0.0)
    return a.to(tl.float32)


@triton.jit
def _rstd(x_ptr, sq_ptr, eps, K: tl.constexpr, N_SQ: tl.constexpr, BK: tl.constexpr):
    """1 / rms(x): from the N_SQ partial sums of squares at sq_ptr, or from x itself."""
    if N_SQ > 0:
        i = tl.arange(0, BK)
        total = tl.sum(tl.load(sq_ptr + i, mask=i < N_SQ, other=0.0), 0)
        for i0 in range(BK, N_SQ, BK):
            total += tl.sum(tl.load(sq_ptr + i0 + i, mask=i0 + i < N_SQ, other=0.0), 0)
    else:
        rk = tl.arange(0, BK)
        squares = tl.zeros([BK], tl.float32)
        for k0 in range(0, K, BK):
            xs = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            squares += xs * xs
        total = tl.sum(squares, 0)
    return 1.0 / tl.sqrt(total / K + eps)


@triton.jit
def _one_plus(flipped, one, BYTE: tl.constexpr, ASM: tl.constexpr):
    """The float 1 + u / 2**15 for byte BYTE (u) of each word: u as the second byte of 1.0."""
    if ASM:  # one byte permute: 1.0's 0x00, u, then 1.0's 0x80 and 0x3F
        bits = tl.inline_asm_elementwise(
            _PERMUTES[BYTE], "=r,r,r", [flipped, tl.full(flipped.shape, one, tl.int32)],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        bits = (((flipped >> (8 * BYTE)) & 0xFF) << 8) | one
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _half(words, BYTE: tl.constexpr, dtype: tl.constexpr):
    """Input BYTE of each 64-bit word of four 16-bit inputs, in fp32."""
    return ((words >> (16 * BYTE)) & 0xFFFF).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)


@triton.jit
def _words(ptr, k0, K: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
    """The 16-bit values ptr[k0:k0 + BK] as BK / 4 64-bit words of four."""
    wc = k0 // 4 + tl.arange(0, BK // 4)
    wm = _within(wc, K // 4, EVEN)
    return tl.load(ptr.to(tl.pointer_type(tl.int64), bitcast=True) + wc, mask=wm, other=0)


@triton.jit
def _int8_words_product(
    acc, sums, flipped, one, xw, gw, rstd, dt: tl.constexpr, PROLOGUE: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """_int8_product's sums for 16-bit inputs and norm weights given as words of four."""
    for byte in tl.static_range(4):
        a = _half(xw, byte, dt)
        if PROLOGUE == 1:
            a = ((a * rstd).to(dt) * _half(gw, byte, dt).to(dt)).to(tl.float32)
        acc += _one_plus(flipped, one, byte, ASM) * a[None, :]
        sums += a
    return acc, sums


@triton.jit
def _int8_product(
    acc, sums, words, one, x_ptr, g_ptr, k0, rstd, K: tl.constexpr, PROLOGUE: tl.constexpr,
    BK: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """acc + Σ over each word's four weights of (1 + (q + 128) / 2**15) * a, for the
    (BN, BK / 4) words of int8 weights at k0; sums + the inputs, four by four."""
    cols = tl.arange(0, BK // 4)
    flipped = words ^ _SIGN_BITS  # each byte now u = q + 128, in [1, 255]
    dt: tl.constexpr = x_ptr.dtype.element_ty
    if dt.primitive_bitwidth == 16 and g_ptr.dtype.element_ty == dt:
        # 16-bit inputs (the engine's): a word's four in one 64-bit load, a thread's for
        # four words in one 128-bit load, where each input was a 2-byte load of its own
        # (int8 QKV and O 6–10 points of the copy rate faster: bench/RESULTS-gpu.md, session 64).
        xw = _words(x_ptr, k0, K, BK, EVEN)
        gw = xw
        if PROLOGUE == 1:
            gw = _words(g_ptr, k0, K, BK, EVEN)
        acc, sums = _int8_words_product(acc, sums, flipped, one, xw, gw, rstd, dt, PROLOGUE, ASM)
    else:
        for byte in tl.static_range(4):
            kk = k0 + 4 * cols + byte
            a = _activation(x_ptr, g_ptr, kk, _within(kk, K, EVEN), rstd, PROLOGUE)
            acc += _one_plus(flipped, one, byte, ASM) * a[None, :]
            sums += a
    return acc, sums


@triton.jit
def _widened(w, FP8: tl.constexpr):
    """A tile of weights in fp32; fp8 ones arrive as their bytes (a masked fp8 load's 0 would
    not be a byte)."""
    if FP8:
        w = w.to(tl.float8e4nv, bitcast=True)
    return w.to(tl.float32)


@triton.jit
def _first_ahead(
    x_ptr, g_ptr, sq_ptr, rows, nmask, eps, one, K: tl.constexpr, PROLOGUE: tl.constexpr,
    N_SQ: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
    INT8: tl.constexpr, FP8: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The product of the tile's rows, its first weight tile requested before the wait for the
    previous kernel and each later one in turn (many programs an SM keep the memory busy)."""
    PER: tl.constexpr = 4 if INT8 else 1
    KW: tl.constexpr = K // PER
    cols = tl.arange(0, BK // PER)
    first = tl.load(rows + cols[None, :], mask=nmask[:, None] & _within(cols, KW, EVEN)[None, :],
                    other=0, eviction_policy="evict_first")  # fmt: skip
    # Int8 NORM: the first tile's norm weights before the wait and its inputs right after, so
    # that their round trip overlaps rstd's (the sums of squares, then a block-wide sum) instead
    # of following it (+0.2% int8 batch-1; bf16 loses 1.6% with the same: bench/RESULTS-gpu.md,
    # session 68). 16-bit inputs as words, as _int8_product reads them.
    dt: tl.constexpr = x_ptr.dtype.element_ty
    AHEAD: tl.constexpr = (
        PROLOGUE == 1 and INT8 and dt.primitive_bitwidth == 16 and g_ptr.dtype.element_ty == dt
    )
    if AHEAD:
        g0 = _words(g_ptr, 0, K, BK, EVEN)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's outputs are complete from here on
        tl.extra.cuda.gdc_launch_dependents()
    if AHEAD:
        x0 = _words(x_ptr, 0, K, BK, EVEN)
    rstd = 1.0
    if PROLOGUE == 1:
        rstd = _rstd(x_ptr, sq_ptr, eps, K, N_SQ, BK)
    if INT8:
        acc = tl.zeros([BN, BK // 4], tl.float32)  # summed over the tile's width at the end
        sums = tl.zeros([BK // 4], tl.float32)
        if AHEAD:
            acc, sums = _int8_words_product(
                acc, sums, first ^ _SIGN_BITS, one, x0, g0, rstd, dt, PROLOGUE, ASM
            )
        else:
            acc, sums = _int8_product(
                acc, sums, first, one, x_ptr, g_ptr, 0, rstd, K, PROLOGUE, BK, EVEN, ASM
            )
        for k0 in range(BK, K, BK):
            wk = k0 // 4 + cols
            wm = nmask[:, None] & _within(wk, KW, EVEN)[None, :]
            w = tl.load(rows + wk[None, :], mask=wm, other=0, eviction_policy="evict_first")
            acc, sums = _int8_product(
                acc, sums, w, one, x_ptr, g_ptr, k0, rstd, K, PROLOGUE, BK, EVEN, ASM
            )
        # Σ (1 + u/2**15) a = Σ a + (Σ q a + 128 Σ a) / 2**15: Σ q a is what follows.
        total = tl.sum(sums, 0)
        y = 32768.0 * (tl.sum(acc, 1) - total) - 128.0 * total
    else:
        rk = tl.arange(0, BK)
        a = _activation(x_ptr, g_ptr, rk, _within(rk, K, EVEN), rstd, PROLOGUE)
        acc = _widened(first, FP8) * a[None, :]  # (BN, BK), summed over K once at the end
        for k0 in range(BK, K, BK):
            kk = k0 + rk
            km = _within(kk, K, EVEN)
            wm = nmask[:, None] & km[None, :]
            w = tl.load(rows + kk[None, :], mask=wm, other=0, eviction_policy="evict_first")
            a = _activation(x_ptr, g_ptr, kk, km, rstd, PROLOGUE)
            acc += _widened(w, FP8) * a[None, :]
        y = tl.sum(acc, 1)
    return y


@triton.jit
def _prefetch(ptrs):
    """Ask for the lines at ptrs in L1 without holding registers for them across the products
    (loads into registers here cost O's tiles a program an SM)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L1 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _row_gemv(
    x_ptr, g_ptr, sq_ptr, w_ptr, s_ptr, res_ptr, out_ptr, sq_out_ptr, N, eps, one,
    K: tl.constexpr, PROLOGUE: tl.constexpr, N_SQ: tl.constexpr, EPILOGUE: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, INT8: tl.constexpr,
    FP8: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    t = tl.arange(0, BN)
    if EPILOGUE == 2:  # SWIGLU: N gate rows then N up rows; tile rows alternate gate, up
        hn = pid * (BN // 2) + t // 2
        rn = hn + (t % 2) * N
        nmask = _within(hn, N, EVEN)
    else:
        rn = pid * BN + t
        nmask = _within(rn, N, EVEN)
    # A row of w is K weights, or K / 4 words of four int8 weights; a tile BK weights wide.
    PER: tl.constexpr = 4 if INT8 else 1
    rows = w_ptr + rn.to(tl.int64)[:, None] * (K // PER)
    if (INT8 or FP8) and ASM:
        # The row scales are weights: fetched before the wait, the epilogue reads them from L1
        # rather than waiting on L2 after the products (the residual fetched so too gained
        # nothing: bench/RESULTS-gpu.md, session 66).
        _prefetch(s_ptr + tl.where(nmask, rn, 0))
    y = _first_ahead(x_ptr, g_ptr, sq_ptr, rows, nmask, eps, one, K, PROLOGUE, N_SQ, BN, BK, EVEN,
                     INT8, FP8, ASM, PDL)  # fmt: skip
    if INT8 or FP8:
        y *= tl.load(s_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    if EPILOGUE == 1:  # RESIDUAL: the product rounded, added to the stream, rounded again
        s = y.to(dt).to(tl.float32) + tl.load(res_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        stream = s.to(dt)
        tl.store(out_ptr + rn, stream, mask=nmask)
        sf = stream.to(tl.float32)
        tl.store(sq_out_ptr + pid, tl.sum(sf * sf, 0))
    elif EPILOGUE == 2:  # SWIGLU
        gate, up = tl.split(tl.reshape(y.to(dt).to(tl.float32), [BN // 2, 2]))
        h = gate / (1.0 + tl.exp(-gate)) * up
        hn = pid * (BN // 2) + tl.arange(0, BN // 2)
        tl.store(out_ptr + hn, h.to(dt), mask=hn < N)
    else:
        tl.store(out_ptr + rn, y.to(dt), mask=nmask)


def _tile(n: int, k: int, weight_bytes: int) -> tuple[int, int, int]:
    """(BN, BK, warps) for an N × K product, the best measured at the LLaMA-3-8B shapes
    (bench/RESULTS-gpu.md): bf16 on an H100 and an H200, fp8 on an H200, int8 on an H100 (on an
    H200 the other tiles tried were no faster).

    bf16: 4 rows a program, 8 warps, and wide loads keep enough bytes in flight: 2,048 inputs
    (4,096 for the products of more than 4,096 rows was slower on both cards). Int8, its inputs
    read as words: 8 warps; 16 rows a program for the products of 4,096 inputs (QKV 1,024
    inputs a tile, O 2,048), 8 for down's 14,336 (2,048 a tile); 32 rows of 512 inputs where
    gate/up or the head are not on row_gemv_tc.
    (Splitting K across programs, the last to finish summing the parts, was slower for every
    shape, bf16 and int8; so was requesting the next tiles before using the one in hand.)
    FP8 (weight_bytes 0: a conversion, not int8's arithmetic): 8 rows and 4 warps, narrower
    loads for the 14,336-input rows."""
    if weight_bytes == 0:
        return 8, 1024 if k > 4096 else min(4096, triton.next_power_of_2(k)), 4
    if weight_bytes == 1:
        if k > 4096:
            return 8, 2048, 8
        if n > 8192:
            return 32, 512, 4
        return 16, 1024 if n > 4096 else 2048, 8
    return 4, min(2048, triton.next_power_of_2(k)), 8


def row_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    prologue: int = PLAIN,
    norm_weight: torch.Tensor | None = None,
    squares: torch.Tensor | None = None,
    eps: float = 0.0,
    epilogue: int = STORE,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    pdl: bool = False,
    tile: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = weight @ prologue(x) for one row x (1, K), through an epilogue.

    weight: (N, K) in x's dtype, or int8 or float8_e4m3fn with `scale` (N,) (w = q * scale per
    row; int8: K a multiple of 4). Prologue NORM: the input is rms_norm(x) * norm_weight, x's
    sum of squares being the sum of `squares` (RESIDUAL's partial sums) where given.
    Epilogues: STORE returns (y, None), y (1, N) in out_dtype (default x's dtype); RESIDUAL
    returns (residual + y, its partial sums of squares), residual (1, N); SWIGLU, weight gate
    rows then up rows (2F, K), returns (silu(gate) * up (1, F), None).
    tile: (rows, inputs, warps) a program, `_tile`'s choice where None."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.is_contiguous() and weight.is_contiguous()
    int8, fp8 = weight.dtype == torch.int8, weight.dtype == torch.float8_e4m3fn
    assert (scale is not None) == (int8 or fp8) and (int8 or fp8 or weight.dtype == x.dtype)
    assert (prologue == NORM) == (norm_weight is not None)
    assert (epilogue == RESIDUAL) == (residual is not None)
    bn, bk, warps = tile or _tile(n, k, 0 if fp8 else weight.element_size())
    if epilogue == SWIGLU:
        assert n % 2 == 0 and bn % 2 == 0
        n //= 2
    rows = bn // 2 if epilogue == SWIGLU else bn  # of the output, a program
    programs = triton.cdiv(n, rows)
    dtype = x.dtype if epilogue == RESIDUAL else out_dtype or x.dtype
    out = torch.empty((1, n), dtype=dtype, device=x.device)
    sq_out = torch.empty(programs if epilogue == RESIDUAL else 1, dtype=torch.float32,
                         device=x.device)  # fmt: skip
    if int8:
        assert k % 4 == 0 and bk % 4 == 0
        weight = weight.view(torch.int32)  # words of four weights, read 32 bits at a time
    elif fp8:
        weight = weight.view(torch.int8)
    _row_gemv[(programs,)](
        x, x if norm_weight is None else norm_weight, sq_out if squares is None else squares,
        weight, x if scale is None else scale, x if residual is None else residual, out, sq_out,
        n, eps, _ONE, K=k, PROLOGUE=prologue, N_SQ=0 if squares is None else squares.numel(),
        EPILOGUE=epilogue, BN=bn, BK=bk, EVEN=n % rows == 0 and k % bk == 0, INT8=int8,
        FP8=fp8, ASM=x.is_cuda, PDL=pdl, num_warps=warps,
        launch_pdl=pdl,
    )  # fmt: skip
    return out, sq_out if epilogue == RESIDUAL else None
