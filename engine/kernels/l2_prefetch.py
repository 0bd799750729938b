"""Weights asked into L2 ahead of the kernel that reads them (Hopper's bulk prefetch).

A batch-1 decode step is a chain of products, each waiting for the one before; across each
dependency the memory idles for a few µs while the last programs of one product finish and the
next one's first loads travel. Weights never depend on the chain, so a product's programs can
ask L2 for the next product's first bytes while they stream their own: the memory stays busy
across the dependency, and the next product starts on lines already in L2. One thread a program
issues one `cp.async.bulk.prefetch.L2` for the program's share (whole 16-byte units, at most
1 MiB: the instruction's size field); nothing waits for it and nothing is held in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SHARE = 1 << 20  # bytes one bulk prefetch may ask for (a 16-bit count of 16-byte units)
ASM = (  # one thread a program asks for `size` ($2) bytes at $1
    "{ .reg .pred p, q; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
    "setp.gt.s32 q, $2, 0; and.pred p, p, q; "
    "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }"
)
_ASM: tl.constexpr = tl.constexpr(ASM)


@triton.jit
def prefetch_share(base_ptr, total, pid, programs):
    """Ask L2 for program pid's share of the `total` bytes at base_ptr (an int8 pointer, 16-byte
    aligned; total a multiple of 16)."""
    share = tl.cdiv(total, programs * 16) * 16
    start = pid.to(tl.int64) * share
    size = tl.minimum(tl.maximum(total - start, 0), share).to(tl.int32)
    tl.inline_asm_elementwise(_ASM, "=r,l,r", [base_ptr + start, size], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip


def prefetch_bytes(device: torch.device) -> tuple[int, int]:
    """Bytes of the next product's weights a batch-1 product asks L2 for on this device: QKV of
    O's (across attention, when the memory is otherwise idle), every other product of the next
    one's. The engine's choice, measured in bench/RESULTS-gpu.md: none yet."""
    return 0, 0


def prefetch_args(
    weights: torch.Tensor | None, limit: int, programs: int
) -> tuple[torch.Tensor | None, int]:
    """The bytes to ask for (the first `limit` of `weights`, whole 16-byte units) as a kernel's
    (int8 tensor, count); (None, 0) where there is nothing to ask, or no bulk prefetch (before
    Hopper)."""
    if weights is None or limit <= 0 or not weights.is_cuda:
        return None, 0
    if torch.cuda.get_device_capability(weights.device)[0] < 9:
        return None, 0
    data = weights.view(torch.int8).reshape(-1)
    count = min(limit, data.numel()) // 16 * 16
    assert data.data_ptr() % 16 == 0, "bulk prefetch needs 16-byte aligned weights"
    assert count <= programs * MAX_SHARE, f"{count} bytes over {programs} programs' prefetches"
    return (data, count) if count else (None, 0)
