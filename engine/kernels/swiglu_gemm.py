"""A prompt's gate/up product with SiLU·up in its epilogue (Triton, TMA loads, persistent).

The fused weight holds gate rows then up rows, (2F, K). Viewed as (2, F, K), one TMA block
(2, BN, BK) brings a tile's gate rows [n, n + BN) and the matching up rows together, so a single
product fills a (BM, 2 BN) accumulator whose halves are that tile's gate and up columns. The
epilogue splits it in registers (each thread holds both halves of its columns) and stores
silu(gate) * up, (BM, BN): gate/up itself is never written to memory nor read back, which a
separate SiLU·up kernel does at the copy rate (1.3 ms of a 2,048-token prompt on an H200).
One accumulator is the point: two (one for gate, one for up) made session 37's kernel 20%
slower than cuBLAS.

On an H200 it is faster than cuBLAS + SiLU·up at 2,048 rows and slower at 512
(bench/RESULTS-gpu.md, session 41), so engine/ops.py's gate_up_silu takes it for steps of
1,024 rows or more, which run eagerly (CUDA graphs serve steps of up to 512 tokens).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# (BM, BN, BK, GROUP_M, warps, stages, warp-specialized): the fastest of eight tilings at 2,048
# rows (bench/RESULTS-gpu.md, session 41).
TILE = (128, 128, 64, 8, 8, 3, True)


@triton.jit(do_not_specialize=["M"])
def _swiglu_gemm(
    x_ptr, w_ptr, o_ptr, M, F, K,
    NUM_SMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, [2, F, K], [F * K, K, 1], [2, BN, BK])
    o_desc = tl.make_tensor_descriptor(o_ptr, [M, F], [F, 1], [BM, BN])
    num_m = tl.cdiv(M, BM)
    tiles = num_m * (F // BN)
    in_group = GROUP_M * (F // BN)
    # Persistent: program p takes tiles p, p + NUM_SMS, ...; GROUP_M row tiles share each weight
    # tile in turn, so a weight tile is read from HBM once per group, not once per row tile.
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True, warp_specialize=WS):
        first_m = tile // in_group * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + tile % in_group % size_m
        pid_n = tile % in_group // size_m
        acc = tl.zeros([BM, 2 * BN], tl.float32)
        for k in range(tl.cdiv(K, BK)):
            a = x_desc.load([pid_m * BM, k * BK])
            b = w_desc.load([0, pid_n * BN, k * BK]).reshape(2 * BN, BK)
            acc = tl.dot(a, b.T, acc)
        gate, up = acc.reshape(BM, 2, BN).permute(0, 2, 1).split()
        out = gate / (1.0 + tl.exp(-gate)) * up
        o_desc.store([pid_m * BM, pid_n * BN], out.to(o_desc.dtype))


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Where the kernel writes its tensor descriptors (Triton asks for it at each launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@functools.cache
def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter, in the tests
    return torch.cuda.get_device_properties(device).multi_processor_count


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight.T with SiLU·up can run here: a GPU with TMA (Hopper or later), 16-bit
    floats, contiguous operands whose rows are whole 16-byte units, and whole weight tiles."""
    tma = x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] >= 9
    return (
        tma
        and hasattr(tl, "make_tensor_descriptor")
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % 8 == 0
        and weight.shape[0] % (2 * TILE[1]) == 0
    )


def swiglu_gemm(
    x: torch.Tensor, weight: torch.Tensor, tile: tuple[int | bool, ...] = TILE
) -> torch.Tensor:
    """x (M, K), weight (2F, K), gate rows then up rows → silu(x @ gate.T) * (x @ up.T), (M, F)."""
    bm, bn, bk, group_m, warps, stages, ws = tile
    m, k = x.shape
    f = weight.shape[0] // 2
    out = torch.empty(m, f, dtype=x.dtype, device=x.device)
    triton.set_allocator(_scratch)
    programs = min(_sms(x.device), triton.cdiv(m, int(bm)) * (f // int(bn)))
    _swiglu_gemm[(programs,)](
        x, weight, out, m, f, k, NUM_SMS=programs, BM=bm, BN=bn, BK=bk, GROUP_M=group_m, WS=ws,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
