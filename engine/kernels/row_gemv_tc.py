"""Int8 and FP8 matrix-vector products on the tensor cores (Gluon), for the two widest one-row
products of a decode step: gate/up (NORM in front, SWIGLU behind) and the output head (NORM in
front).

row_gemv.py widens int8 weights with a byte permute and an FMA each on the CUDA cores: at
gate/up that arithmetic keeps the product under the memory's pace. Here the widening is exact
and cheaper, and the multiply-adds go to the tensor cores:

- A 32-bit word of four weights becomes four fp16 weights with one XOR, two byte permutes and
  two packed subtractions: each byte, its sign bit flipped (u = q + 128), is put under 1024's
  exponent (the fp16 1024 + u) and 1152 is taken off: q, exactly. Four e4m3 weights take two
  conversions of a pair each (every e4m3 value is an fp16 one).
- mma.m16n8k16 multiplies 16 weight rows by the input, fp16 in, fp32 accumulated. The input
  (rms_norm(x) * g, rounded to the model's dtype as model.py does) is widened to fp16 once a
  program and kept in shared memory; fp16 holds every bf16 of that range exactly (`fits`
  checks the range: the normalised input is at most sqrt(K) * max |g|). The product's eight
  columns all hold the input; column 0 is read.
- The mma gives lane (g, q) of a warp the inputs 2q, 2q+1, 2q+8, 2q+9 of each 16 and the same
  positions of rows g and g+8. A dot product does not care in which order k runs, so within
  each 64 inputs the kernel lets logical k (bits e, q0, q1, h, s0, s1) stand for memory k (bits
  e, h, s0, s1, q0, q1): a lane's weights of a row are then 16 bytes of memory in a row, and
  its inputs 16 halves in a row. Relabelling (reshape, permute) moves no data.
- Weights are read coalesced, eight lanes reading 128 bytes of a row, and reach the mma layout
  by a warp shuffle (one lane bit and one register bit trade places); read straight in the mma
  layout (64 bytes of 8 rows an instruction) they were slower.
- Two tiles are in flight per warp, both requested before the wait for the previous kernel
  (programmatic dependent launch, as row_gemv.py), and so is the norm weight; x is copied
  into shared memory asynchronously while the partial sums of squares are read.

The other products stay on row_gemv.py: at QKV, O and down (few rows, or 14,336 inputs a row)
this kernel has too few warps to keep the memory busy. What each choice measured:
bench/RESULTS-gpu.md.
"""

from __future__ import annotations

import functools
import math

import torch

try:  # Gluon, Triton's explicit-layout dialect (experimental; used here with 3.6 and 3.9)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
except ImportError:  # pragma: no cover - an older Triton: row_gemv.py serves every product
    gluon = None

STORE, SWIGLU = 0, 2  # as row_gemv.py
BN, BK, WARPS = 64, 256, 4  # a program's rows and tile width: 16 rows a warp, 128 B a row-lane
_FP16_MAX = 65504.0


def available(device: torch.device) -> bool:
    """Gluon imports and the GPU has the mma.sync shape (Ampere or later)."""
    return (
        gluon is not None
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 8
    )


def fits(n: int, k: int, epilogue: int, norm_weight: torch.Tensor) -> bool:
    """Whether an (n, k) int8 product behind rms_norm(x) * norm_weight can run here: whole
    tiles, and inputs inside fp16's range. Reads norm_weight: call it once, not in a graph."""
    rows = BN // 2 if epilogue == SWIGLU else BN
    if k % BK or (n // 2 if epilogue == SWIGLU else n) % rows or k < 2 * BK:
        return False
    # |x_i| / rms(x) <= sqrt(K); each bf16 rounding adds at most 2**-8.
    largest = math.sqrt(k) * (1 + 2**-8) ** 2 * norm_weight.abs().max().item()
    return largest < _FP16_MAX


def _log2(n: int) -> int:
    return n.bit_length() - 1


@functools.cache  # layouts depend on the tile alone: built once, not at every launch
def _layouts(bk: int, warps: int) -> tuple:
    """(mma, weights as the mma reads them, weights as loaded, inputs (bk, 8) as read) for a
    (16 * warps, bk) int8 tile held as (16 * warps, bk / 4) words; bases as in
    gl.DistributedLinearLayout (register, lane, warp, block), coordinates (row, word)."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
    shape = [16 * warps, bk // 4]
    warp = [[16 << i, 0] for i in range(_log2(warps))]
    wide = [[0, 16 << i] for i in range(_log2(bk // 64))]  # the next 64 weights of the row
    # mma: words 4q..4q+3 of rows g and g + 8 (memory k = 16q + 0..15 of each 64)
    frag = gl.DistributedLinearLayout(
        [[0, 1], [0, 2], [8, 0], *wide], [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], warp, [], shape
    )
    # loaded: 8 lanes × 16 bytes along a row, 4 rows an instruction (g's bit 0 in a register)
    coalesced = gl.DistributedLinearLayout(
        [[0, 1], [0, 2], [1, 0], [8, 0], *[[0, 32 << i] for i in range(_log2(bk // 128))]],
        [[0, 4], [0, 8], [0, 16], [2, 0], [4, 0]],
        warp,
        [],
        shape,
    )
    inputs = gl.DistributedLinearLayout(
        [[1, 0], [2, 0], [4, 0], [8, 0], *[[64 << i, 0] for i in range(_log2(bk // 64))]],
        [[16, 0], [32, 0], [0, 1], [0, 2], [0, 4]],  # the column: the lane's g
        [[0, 0]] * _log2(warps),
        [],
        [bk, 8],
    )
    return mma, frag, coalesced, inputs


if gluon is not None:
    # Gluon is experimental: Triton 3.9 renamed the cp.async copy and the CTA barrier (the H200
    # machine has 3.6).
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    # One word of four int8 weights → four fp16 weights, exactly (see the module's docstring).
    _WIDEN: gl.constexpr = gl.constexpr(
        "{ .reg .b32 t, m, p, q; xor.b32 t, $4, 0x80808080; mov.b32 m, 0x64806480;"
        " prmt.b32 p, t, 0x64646464, 0x4140; prmt.b32 q, t, 0x64646464, 0x4342;"
        " sub.rn.f16x2 p, p, m; sub.rn.f16x2 q, q, m;"
        " mov.b32 {$0, $1}, p; mov.b32 {$2, $3}, q; }"
    )
    # One word of four e4m3 weights → four fp16 weights, exactly: the hardware converts pairs.
    _WIDEN_FP8: gl.constexpr = gl.constexpr(
        "{ .reg .b16 lo, hi; .reg .b32 p, q; mov.b32 {lo, hi}, $4;"
        " cvt.rn.f16x2.e4m3x2 p, lo; cvt.rn.f16x2.e4m3x2 q, hi;"
        " mov.b32 {$0, $1}, p; mov.b32 {$2, $3}, q; }"
    )

    @gluon.jit
    def _logical(t, ROWS: gl.constexpr, TK: gl.constexpr, K_AXIS: gl.constexpr):
        """Memory k (bits e, h, s0, s1, q0, q1 of each 64) relabelled as the mma's k (e, q0,
        q1, h, s0, s1): a permutation of index bits, so no data moves."""
        if K_AXIS == 1:
            t = gl.reshape(t, [ROWS, TK // 64, 4, 4, 2, 2])  # rows, c, q, s, h, e
            t = gl.permute(t, [0, 1, 3, 4, 2, 5])  # rows, c, s, h, q, e
            return gl.reshape(t, [ROWS, TK])
        else:
            t = gl.reshape(t, [TK // 64, 4, 4, 2, 2, ROWS])
            t = gl.permute(t, [0, 2, 3, 1, 4, 5])
            return gl.reshape(t, [TK, ROWS])

    @gluon.jit
    def _griddep(asm: gl.constexpr):
        gl.inline_asm_elementwise(asm, "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _step(acc, words, xs, TN: gl.constexpr, TK: gl.constexpr, MMA: gl.constexpr,
              FRAG: gl.constexpr, INPUTS: gl.constexpr, FP8: gl.constexpr):  # fmt: skip
        """acc + the (TN, TK) int8 (or e4m3) tile `words` times the staged input chunk xs."""
        words = gl.convert_layout(words, FRAG)  # a warp shuffle from the coalesced load
        w0, w1, w2, w3 = gl.inline_asm_elementwise(
            _WIDEN_FP8 if FP8 else _WIDEN, "=h,=h,=h,=h,r", [words], dtype=(gl.float16,) * 4,
            is_pure=True, pack=1,
        )  # fmt: skip
        a = gl.reshape(gl.join(gl.join(w0, w2), gl.join(w1, w3)), [TN, TK])  # bytes in k order
        a = gl.convert_layout(_logical(a, TN, TK, 1), gl.DotOperandLayout(0, MMA, 2))
        x = xs.load(gl.SliceLayout(1, INPUTS))
        b = gl.broadcast(gl.expand_dims(x, 1), gl.full([TK, 8], 0, gl.float16, INPUTS))[0]
        b = gl.convert_layout(_logical(b, 8, TK, 0), gl.DotOperandLayout(1, MMA, 2))
        return mma_v2(a, b, acc)

    @gluon.jit
    def _row_gemv_tc(
        x_ptr, g_ptr, sq_ptr, w_ptr, s_ptr, out_ptr, N, eps,
        K: gl.constexpr, N_SQ: gl.constexpr, EPILOGUE: gl.constexpr, TN: gl.constexpr,
        TK: gl.constexpr, PDL: gl.constexpr, MMA: gl.constexpr,
        FRAG: gl.constexpr, LOADED: gl.constexpr, INPUTS: gl.constexpr, FP8: gl.constexpr,
    ):  # fmt: skip
        W: gl.constexpr = gl.num_warps()
        pid = gl.program_id(0)
        t = gl.arange(0, TN, layout=gl.SliceLayout(1, LOADED))
        # SWIGLU: the tile's first half are gate rows, the second half their up rows.
        half = pid * (TN // 2) + t % (TN // 2) + (t // (TN // 2)) * N
        rn = half if EPILOGUE == 2 else pid * TN + t
        cols = gl.arange(0, TK // 4, layout=gl.SliceLayout(0, LOADED))
        rows = w_ptr + rn.to(gl.int64)[:, None] * (K // 4) + cols[None, :]
        # Weights and the norm weight never depend on the previous kernel: two tiles and g are
        # requested before the wait; x is copied into shared memory (cp.async) while the sum of
        # squares is read, so the two reads' latencies overlap.
        w = gl.load(rows, eviction_policy="evict_first")
        w2 = gl.load(rows + TK // 4, eviction_policy="evict_first")
        XL: gl.constexpr = gl.BlockedLayout([TK // (32 * W)], [32], [W], [0])
        xo = gl.arange(0, TK, layout=XL)
        RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        gs = gl.allocate_shared_memory(g_ptr.dtype.element_ty, [K // TK, TK], RAW)
        xs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [K // TK, TK], RAW)
        for c in gl.static_range(K // TK):
            _async_load(gs.index(c), g_ptr + c * TK + xo)
        # The row scales too (weights: a register a thread), so the epilogue waits on no load.
        YL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        yr = gl.arange(0, TN, layout=YL)
        HALF: gl.constexpr = TN // 2
        if EPILOGUE == 2:
            scale = gl.load(s_ptr + pid * HALF + yr % HALF + (yr // HALF) * N)
        else:
            scale = gl.load(s_ptr + pid * TN + yr)
        if PDL:
            _griddep("griddepcontrol.wait; // $0")
            _griddep("griddepcontrol.launch_dependents; // $0")
        for c in gl.static_range(K // TK):
            _async_load(xs.index(c), x_ptr + c * TK + xo)
        async_copy.commit_group()

        # rstd from the partial sums of squares (or x itself), as row_gemv.py's NORM.
        SL: gl.constexpr = gl.BlockedLayout([4], [32], [W], [0])
        si = gl.arange(0, 128 * W, layout=SL)
        if N_SQ > 0:
            total = gl.sum(gl.load(sq_ptr + si, mask=si < N_SQ, other=0.0), 0)
            for i0 in range(128 * W, N_SQ, 128 * W):
                total += gl.sum(gl.load(sq_ptr + i0 + si, mask=i0 + si < N_SQ, other=0.0), 0)
        else:
            squares = gl.zeros([128 * W], gl.float32, SL)
            for k0 in range(0, K, 128 * W):
                xk = gl.load(x_ptr + k0 + si, mask=k0 + si < K, other=0.0).to(gl.float32)
                squares += xk * xk
            total = gl.sum(squares, 0)
        rstd = 1.0 / gl.sqrt(total / K + eps)
        # The input, normalised and widened to fp16 once, for every k step.
        staged = gl.allocate_shared_memory(gl.float16, [K // TK, TK], RAW)
        async_copy.wait_group(0)
        _barrier()
        for c in gl.static_range(K // TK):
            x = xs.index(c).load(XL).to(gl.float32)
            a = (x * rstd).to(x_ptr.dtype.element_ty) * gs.index(c).load(XL)
            staged.index(c).store(a.to(gl.float16))
        _barrier()

        acc = gl.zeros([TN, 8], gl.float32, MMA)
        for i in range(0, K // TK - 2):
            nxt = gl.load(rows + (i + 2) * (TK // 4), eviction_policy="evict_first")
            acc = _step(acc, w, staged.index(i), TN, TK, MMA, FRAG, INPUTS, FP8)
            w = w2
            w2 = nxt
        acc = _step(acc, w, staged.index(K // TK - 2), TN, TK, MMA, FRAG, INPUTS, FP8)
        acc = _step(acc, w2, staged.index(K // TK - 1), TN, TK, MMA, FRAG, INPUTS, FP8)
        n8 = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        y = gl.sum(gl.where((n8 == 0)[None, :], acc, 0.0), 1)

        y = gl.convert_layout(y, YL) * scale.to(gl.float32)
        dt: gl.constexpr = out_ptr.dtype.element_ty
        if EPILOGUE == 2:  # the model rounds gate and up, then silu(gate) * up
            ys = gl.allocate_shared_memory(gl.float32, [TN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            ys.store(y.to(dt).to(gl.float32))
            _barrier()
            gate = ys.slice(0, HALF).load(YL)
            up = ys.slice(HALF, HALF).load(YL)
            h = gate / (1.0 + gl.exp(-gate)) * up
            gl.store(out_ptr + pid * HALF + gl.arange(0, HALF, layout=YL), h.to(dt))
        else:
            gl.store(out_ptr + pid * TN + yr, y.to(dt))


def row_gemv_tc(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_weight: torch.Tensor,
    squares: torch.Tensor | None = None,
    eps: float = 0.0,
    epilogue: int = STORE,
    out_dtype: torch.dtype | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, None]:
    """row_gemv(x, weight, scale, prologue=NORM, ...) for int8 or e4m3 weights where `fits`: y =
    weight @ (rms_norm(x) * norm_weight), then STORE (1, N) in out_dtype, or SWIGLU (weight
    gate rows then up rows) silu(gate) * up (1, F). Returns (y, None), as row_gemv."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.is_contiguous() and weight.is_contiguous()
    fp8 = weight.dtype == torch.float8_e4m3fn
    assert (fp8 or weight.dtype == torch.int8) and scale.shape == (n,)
    if epilogue == SWIGLU:
        n //= 2
    programs = n // (BN // 2 if epilogue == SWIGLU else BN)
    out = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    mma, frag, coalesced, inputs = _layouts(BK, WARPS)
    _row_gemv_tc[(programs,)](
        x, norm_weight, x if squares is None else squares, weight.view(torch.int32), scale, out,
        n, eps, K=k, N_SQ=0 if squares is None else squares.numel(), EPILOGUE=epilogue, TN=BN,
        TK=BK, PDL=pdl, MMA=mma, FRAG=frag, LOADED=coalesced, INPUTS=inputs, FP8=fp8,
        num_warps=WARPS, launch_pdl=pdl,
    )  # fmt: skip
    return out, None
