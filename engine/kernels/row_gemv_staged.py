"""An int8 one-row product whose weights are all in shared memory before its input exists
(Gluon): the O projection of a batch-1 decode step, behind attention.

In the launched chain (engine/row_decode.py) O's programs start while attention runs
(programmatic dependent launch) and request their first weight tile before they wait for it;
row_gemv.py keeps that tile in registers, and the register file holds only about half of O's
int8 weights (16.8 MB for LLaMA-3-8B). The other half streams in after attention ends, and
attention's microseconds leave the memory mostly idle. Here each program copies its whole
slice of rows into shared memory (cp.async, no registers held) before the wait, so the
whole product is in flight during attention and what is left after it is the arithmetic.

The arithmetic is row_gemv.py's int8 path (the same rounding): each byte permuted into the
float 1 + u / 2**15, one FMA with its input, the inputs summed beside, Σ q a recovered at the
end; inputs read as 64-bit words of four; the RESIDUAL epilogue (the new stream and one partial
sum of squares a program). Each thread reads back only the words it copied, so no barrier is
needed between the copies and the reads.
"""

from __future__ import annotations

import torch

try:  # Gluon, Triton's explicit-layout dialect (experimental)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
except ImportError:  # pragma: no cover - an older Triton: row_gemv.py serves every product
    gluon = None

ROWS, WARPS = 16, 8  # a program's rows (its slice, K bytes each, in shared memory) and warps
_CHUNK = 128  # words of a row in a copy group: 4 a lane
_SHARED_BYTES = 200 << 10  # a program's slice must fit an SM's shared memory with room to spare
_ONE = 0x3F800000


def available(device: torch.device) -> bool:
    """Gluon imports and the GPU has cp.async (Ampere or later)."""
    return (
        gluon is not None
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 8
    )


def fits(n: int, k: int, device: torch.device) -> bool:
    """Whether an (n, k) int8 product runs here: whole tiles, and every program resident at
    once with its slice (else the later programs' copies start only after attention)."""
    if n % ROWS or k % (4 * _CHUNK) or ROWS * k > _SHARED_BYTES:
        return False
    props = torch.cuda.get_device_properties(device)
    shared = getattr(props, "shared_memory_per_multiprocessor", 0)
    per_sm = shared // (ROWS * k + 2 * k + 1024)  # weights, the input's words, the sums
    return n // ROWS <= per_sm * props.multi_processor_count

if gluon is not None:
    _PERMUTES: gl.constexpr = gl.constexpr(
        tuple(f"prmt.b32 $0, $1, $2, {0x7604 + 16 * byte:#x};" for byte in range(4))
    )

    @gluon.jit
    def _griddep(asm: gl.constexpr):
        gl.inline_asm_elementwise(asm, "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _row_gemv_staged(
        x_ptr, w_ptr, s_ptr, res_ptr, out_ptr, sq_out_ptr, one,
        K: gl.constexpr, TN: gl.constexpr, CHUNK: gl.constexpr, PDL: gl.constexpr,
    ):  # fmt: skip
        W: gl.constexpr = gl.num_warps()
        C: gl.constexpr = K // 4 // CHUNK  # copy groups a row
        L: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
        pid = gl.program_id(0)
        rn = pid * TN + gl.arange(0, TN, layout=gl.SliceLayout(1, L))
        cols = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, L))
        rows = w_ptr + rn.to(gl.int64)[:, None] * (K // 4) + cols[None, :]
        RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        staged = gl.allocate_shared_memory(gl.int32, [C, TN, CHUNK], RAW)
        for c in gl.static_range(C):
            async_copy.async_copy_global_to_shared(
                staged.index(c), rows + c * CHUNK, eviction_policy="evict_first"
            )
        async_copy.commit_group()
        # The stream was written two kernels ago (down), complete before attention started.
        scale = gl.load(s_ptr + rn).to(gl.float32)
        residual = gl.load(res_ptr + rn).to(gl.float32)
        if PDL:
            _griddep("griddepcontrol.wait; // $0")
            _griddep("griddepcontrol.launch_dependents; // $0")
        # The input, 8 KB, into shared memory too: read from registers chunk by chunk, each
        # chunk's load would be a round trip to L2 of its own.
        XL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
        xc = gl.arange(0, C, layout=gl.SliceLayout(1, XL))
        xk = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, XL))
        words_of_x = x_ptr.to(gl.pointer_type(gl.int64), bitcast=True)
        xs = gl.allocate_shared_memory(gl.int64, [C, CHUNK], RAW)
        async_copy.async_copy_global_to_shared(xs, words_of_x + xc[:, None] * CHUNK + xk[None, :])
        async_copy.commit_group()
        dt: gl.constexpr = x_ptr.dtype.element_ty
        ones = gl.full([TN, CHUNK], 0, gl.int32, L) + one
        acc = gl.zeros([TN, CHUNK], gl.float32, L)
        sums = gl.zeros([1, CHUNK], gl.float32, L)
        async_copy.wait_group(0)
        for c in gl.static_range(C):
            xw = xs.slice(c, 1).load(L)  # (1, CHUNK): four inputs a word
            flipped = staged.index(c).load(L) ^ -0x7F7F7F80  # each byte u = q + 128
            for byte in gl.static_range(4):
                half = ((xw >> (16 * byte)) & 0xFFFF).to(gl.int16)
                a = half.to(dt, bitcast=True).to(gl.float32)
                bits = gl.inline_asm_elementwise(
                    _PERMUTES[byte], "=r,r,r", [flipped, ones], dtype=gl.int32, is_pure=True,
                    pack=1,
                )  # fmt: skip
                acc += bits.to(gl.float32, bitcast=True) * a
                sums += a
        total = gl.sum(gl.sum(sums, 1), 0)
        y = 32768.0 * (gl.sum(acc, 1) - total) - 128.0 * total
        y = y * scale
        # RESIDUAL, as row_gemv.py: the product rounded, added to the stream, rounded again.
        stream = (y.to(dt).to(gl.float32) + residual).to(dt)
        gl.store(out_ptr + rn, stream)
        sf = stream.to(gl.float32)
        gl.store(sq_out_ptr + pid, gl.sum(sf * sf, 0))


def row_gemv_staged(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    residual: torch.Tensor,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """row_gemv(x, weight, scale, epilogue=RESIDUAL, residual=residual) for int8 weights where
    `fits`: (residual + weight @ x (1, N), its partial sums of squares)."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.is_contiguous() and weight.is_contiguous()
    assert weight.dtype == torch.int8 and scale.shape == (n,) and residual.shape == (1, n)
    assert x.dtype in (torch.bfloat16, torch.float16) and residual.dtype == x.dtype
    programs = n // ROWS
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    squares = torch.empty(programs, dtype=torch.float32, device=x.device)
    _row_gemv_staged[(programs,)](
        x, weight.view(torch.int32), scale, residual, out, squares, _ONE, K=k, TN=ROWS,
        CHUNK=_CHUNK, PDL=pdl, num_warps=WARPS, launch_pdl=pdl,
    )  # fmt: skip
    return out, squares
