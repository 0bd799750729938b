"""The model's few fusable operations: fused Triton kernels on CUDA, fused native kernels on CPU
(engine/cpu_kernels.py) for fp32 where they could be built, PyTorch elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.kv_cache import to_kv
from engine.rope import apply_rope

# Rows from which a prompt's gate/up takes engine/kernels/swiglu_gemm.py: on an H200 it wins at
# 2,048 rows and loses at 512 (bench/RESULTS-gpu.md, session 41).
_FUSED_ROWS = 1024


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); with no residual, of x alone."""
    if x.is_cuda:
        from engine.kernels.fused import add_rms_norm as fused

        return fused(x, residual, weight, eps)
    if cpu_kernels.usable(x):
        normed, summed = torch.ops.tandem.add_rms_norm(x, residual, weight, eps)
        return normed, summed
    summed = x if residual is None else x + residual
    if summed.dtype == torch.float32:
        return F.rms_norm(summed, (summed.shape[-1],), weight, eps), summed  # one fused op
    # Normalise in fp32 whatever the weights' dtype, as the reference implementation does.
    normed = F.rms_norm(summed.float(), (summed.shape[-1],), None, eps)
    return weight * normed.to(summed.dtype), summed


def rope_and_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    n_heads: int,
    n_kv: int,
) -> None:
    """qkv: (T, n_heads + 2 n_kv, hd): RoPE on Q and K in place, then K and V into the pool."""
    if qkv.is_cuda:
        from engine.kernels.fused import rope_and_store as fused

        fused(qkv, cos, sin, pool, slots, n_heads, n_kv)
        return
    if cpu_kernels.usable(qkv) and pool.dtype == qkv.dtype:
        torch.ops.tandem.rope_and_store(qkv, cos, sin, pool, slots, n_heads, n_kv)
        return
    t, _, hd = qkv.shape
    rotated = n_heads + n_kv
    qkv[:, :rotated] = apply_rope(qkv[:, :rotated], cos, sin)
    new_kv = qkv[:, n_heads:].reshape(t, 2, n_kv, hd)
    stored = to_kv(new_kv, pool.dtype)
    if pool.dtype.itemsize == 1:  # index_copy_ has no fp8 kernel on CPU; the bytes are the same
        pool, stored = pool.view(torch.uint8), stored.view(torch.uint8)
    pool.index_copy_(0, slots, stored)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2F) gate then up → (T, F) silu(gate) * up."""
    if gate_up.is_cuda:
        from engine.kernels.fused import silu_mul as fused

        return fused(gate_up)
    if cpu_kernels.usable(gate_up):
        return torch.ops.tandem.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_silu(x: torch.Tensor, gate_up: nn.Module) -> torch.Tensor:
    """silu(gate) * up of gate_up(x), gate_up's output being gate then up. A prompt's rows on a
    GPU with TMA go through one kernel that never writes gate/up out (engine/kernels/
    swiglu_gemm.py); everything else through the product, then silu_mul."""
    if x.is_cuda and x.shape[0] >= _FUSED_ROWS and type(gate_up) is nn.Linear:
        from engine.kernels import swiglu_gemm

        if gate_up.bias is None and swiglu_gemm.fits(x, gate_up.weight):
            return swiglu_gemm.swiglu_gemm(x, gate_up.weight)
    return silu_mul(gate_up(x))
