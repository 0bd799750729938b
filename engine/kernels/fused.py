"""Small fused kernels (Triton) for the decode step, where launches, not bytes, cost the most.

Each replaces a handful of PyTorch ops: residual add + RMSNorm; RoPE on Q and K written back in
place plus the K/V store into the paged pool; SiLU(gate) * up. engine/ops.py chooses between
these and plain PyTorch (CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, D, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    mask = d < D
    x = tl.load(x_ptr + t * stride_x + d, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + t * stride_r + d, mask=mask, other=0.0).to(tl.float32)
    # The running sum is kept in the model's dtype, and normalised as stored.
    summed = x.to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + t * stride_o + d, summed, mask=mask)
    xf = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=mask, other=0.0)
    normed = (xf * rstd).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_o + d, normed * w, mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for x: (T, D); residual may be None."""
    t, d = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x)
    res = residual if residual is not None else x
    _add_rms_norm[(t,)](
        x, res, weight, out, summed, x.stride(0), res.stride(0), out.stride(0), d, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(d),
    )  # fmt: skip
    return out, summed


@triton.jit
def _rope_store(
    qkv_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr,
    stride_qt, stride_qh, stride_ct, stride_slot, stride_kv, stride_ph, stride_st,
    N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr,
    KV_LIMIT: tl.constexpr,
):  # fmt: skip
    # Program (t, g): token t's heads [g * HEADS, (g + 1) * HEADS) of its Q heads, then K heads,
    # then V heads.
    t = tl.program_id(0)
    h = (tl.program_id(1) * HEADS + tl.arange(0, HEADS))[:, None]
    i = tl.arange(0, HALF)[None, :]
    heads = h < N_HEADS + 2 * N_KV
    base = qkv_ptr + t * stride_qt + h * stride_qh
    x1 = tl.load(base + i, mask=heads)  # (HEADS, HALF)
    x2 = tl.load(base + HALF + i, mask=heads)
    # Rotate-half RoPE on Q and K: (x1, x2) → (x1 cos - x2 sin, x2 cos + x1 sin), in fp32.
    c1 = tl.load(cos_ptr + t * stride_ct + i).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + i).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + i).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + i).to(tl.float32)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    rotate = h < N_HEADS + N_KV
    x1 = tl.where(rotate, (f1 * c1 - f2 * s1).to(x1.dtype), x1)
    x2 = tl.where(rotate, (f2 * c2 + f1 * s2).to(x2.dtype), x2)
    tl.store(base + i, x1, mask=rotate)
    tl.store(base + HALF + i, x2, mask=rotate)
    kv = (h - N_HEADS) // N_KV  # 0: K, 1: V
    head = (h - N_HEADS) % N_KV
    slot = tl.load(slot_ptr + t * stride_st)
    dest = pool_ptr + slot * stride_slot + kv * stride_kv + head * stride_ph
    stored = heads & (h >= N_HEADS)
    kv_type = pool_ptr.dtype.element_ty
    if KV_LIMIT > 0:  # an fp8 pool: values as they are (scale 1), saturated, not overflowed
        x1 = tl.clamp(x1.to(tl.float32), -KV_LIMIT, KV_LIMIT)
        x2 = tl.clamp(x2.to(tl.float32), -KV_LIMIT, KV_LIMIT)
    tl.store(dest + i, x1.to(kv_type), mask=stored)
    tl.store(dest + HALF + i, x2.to(kv_type), mask=stored)


def rope_and_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    n_heads: int,
    n_kv: int,
) -> None:
    """qkv: (T, n_heads + 2 n_kv, hd), RoPE applied to Q and K in place; K and V stored at
    `slots` in pool (slots, 2, n_kv, hd). cos, sin: (T, hd)."""
    t, heads, hd = qkv.shape
    block = min(16, triton.next_power_of_2(heads))
    _rope_store[(t, triton.cdiv(heads, block))](
        qkv, cos, sin, pool, slots,
        qkv.stride(0), qkv.stride(1), cos.stride(0),
        pool.stride(0), pool.stride(1), pool.stride(2), slots.stride(0),
        N_HEADS=n_heads, N_KV=n_kv, HEADS=block, HALF=hd // 2,
        KV_LIMIT=torch.finfo(pool.dtype).max if pool.dtype.itemsize == 1 else 0.0,
    )  # fmt: skip


@triton.jit
def _silu_mul(x_ptr, out_ptr, stride_x, stride_o, F, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    f = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = f < F
    gate = tl.load(x_ptr + t * stride_x + f, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + F + f, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * stride_o + f, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2F), gate then up → (T, F) = silu(gate) * up."""
    t, two_f = gate_up.shape
    f = two_f // 2
    out = torch.empty((t, f), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul[(t, triton.cdiv(f, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), f, BLOCK=block
    )
    return out
