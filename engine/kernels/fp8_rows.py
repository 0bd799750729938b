"""Each row of activations scaled into e4m3 by its own absolute maximum (Triton), for the FP8
GEMMs of quant.Fp8Linear: x ≈ q * scale[row].

In plain torch this is seven elementwise passes over fp32 copies of the activations (upcast,
abs, max, divide, clamp, cast), which for a 2,048-token prefill cost more than the FP8 GEMMs
saved; here it is one program a row that reads the row twice (its maximum, then its codes) and
writes one byte a value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rows_to_fp8(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, K,
    LIMIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    widest = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
        widest = tl.maximum(widest, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(widest, 0), 1e-12) / LIMIT
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
        # Clamped before the cast: the conversion need not saturate on every backend.
        # Correctly rounded division (`/` is approximate): the codes are torch's, exactly.
        q = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -LIMIT, LIMIT)
        tl.store(
            q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K
        )


def rows_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (M, K) → (M, K) float8_e4m3fn codes and (M, 1) float32 scales."""
    m, k = x.shape
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    limit = torch.finfo(torch.float8_e4m3fn).max
    block = min(triton.next_power_of_2(k), 2048)
    _rows_to_fp8[(m,)](
        x, codes, scales, x.stride(0), codes.stride(0), k, LIMIT=limit, BLOCK=block, num_warps=4
    )
    return codes, scales
