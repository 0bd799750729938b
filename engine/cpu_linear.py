"""Projections on CPU as oneDNN matmuls over weights packed once, at load, in oneDNN's layout.

A plain `F.linear` on CPU re-lays its weight out for the matmul kernel on every call; packing it
once (what inductor does with frozen weights) removes that, and in bf16 halves the bytes read.
A step of few rows is bound by reading the weights, and there 4-bit weights (4× fewer bytes)
win, which is why `Int4Linear` keeps them for steps of few rows and a packed bf16 copy for the
others (bench/RESULTS-cpu.md has the measurements).
"""

from __future__ import annotations

import torch
from torch import nn

# oneDNN picks its packed layout for this many rows; measured as good from 1 to 512 rows.
ROWS_HINT = 16


def packing_supported(dtype: torch.dtype) -> bool:
    """oneDNN is built in, and for bf16 the CPU multiplies bf16 natively (AVX-512-BF16 or AMX)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """A bias-free linear layer whose weight lives only in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        # An opaque oneDNN tensor: not a parameter or buffer, since it has no storage to save,
        # copy or move; the module is built on the CPU it runs on and never leaves it.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, None, "none", [], "")
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap every float `nn.Linear` of a CPU model for a `PackedLinear`; returns how many."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.bias is None:
                setattr(module, name, PackedLinear(child.weight.detach(), dtype))
                swapped += 1
    return swapped
