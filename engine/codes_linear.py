"""GGUF's 4- and 8-bit weights served as they are by tandem's native CPU kernel.

`CodesLinear` stands in for `nn.Linear` (the model never knows) wherever the native kernels
(engine/cpu_kernels.py) are built. Its matmul quantizes the activations to int8 per block of 32,
as llama.cpp does, and multiplies them with the weight's codes in integers (AVX-512 VNNI).
It is faster than torch's int4 kernel and than a bf16 copy of the weights in oneDNN's packed
layout at every batch a CPU serves (bench/RESULTS-cpu.md), so no float copy is kept at all.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.memory import huge_page_buffer
from engine.quant import GROUP, Q4Blocks

ROWS_PER_GROUP = 16  # the kernel's output rows per vector


def grouped_codes(
    parts: tuple[Q4Blocks, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The kernel's layout (engine/csrc/cpu_kernels.cpp) of one Q4 matrix (Q4_0/Q4_1), or of the
    two a Q8_0 weight was split into: w = scale * u + minimum per block, u an unsigned code.
    Returns codes (N/16, K/32, 16 rows x 32 codes x bits/8) uint8, scale and minimum
    (N/16, K/32, 16) fp16, and the code width in bits."""
    n, k = parts[0].shape
    groups, blocks = n // ROWS_PER_GROUP, k // GROUP
    if len(parts) == 1:
        (only,) = parts
        scale = only.scales
        minimum = only.zeros - 8 * only.scales  # Q4Blocks: w = (code - 8) * scale + zero
        # (group, row, block, half, chunk, t) → (group, block, chunk, row, t, half), where the
        # code index is 16 half + 4 chunk + t: byte 4 row + t of unit `chunk` holds half 0 in
        # its low nibble and half 1 in its high one.
        u = only.codes.view(groups, ROWS_PER_GROUP, blocks, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
        codes = (u[..., 0] | (u[..., 1] << 4)).to(torch.uint8)
        bits = 4
    else:
        high, low = parts  # Q8_0's q = 16 (high - 8) + low, and w = d q with d = low.scales
        q = 16 * (high.codes - 8) + low.codes
        scale = low.scales
        minimum = -128 * scale  # u = q + 128 is unsigned
        # (group, row, block, chunk, t) → (group, block, chunk, row, t): byte 4 row + t of unit
        # `chunk` is code 4 chunk + t.
        u = (q + 128).view(groups, ROWS_PER_GROUP, blocks, 8, 4).permute(0, 2, 3, 1, 4)
        codes = u.to(torch.uint8)
        bits = 8

    def by_group(t: torch.Tensor) -> torch.Tensor:  # (N, K/32) → (N/16, K/32, 16)
        return t.view(groups, ROWS_PER_GROUP, blocks).transpose(1, 2).contiguous().half()

    return codes.reshape(groups, blocks, -1).contiguous(), by_group(scale), by_group(minimum), bits


class CodesLinear(nn.Module):
    """A linear layer over a GGUF Q4_0/Q4_1 weight (one part) or Q8_0 weight (two parts)."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor

    def __init__(self, *parts: Q4Blocks) -> None:
        super().__init__()
        self.out_features, self.in_features = parts[0].shape
        codes, scale, minimum, self.bits = grouped_codes(parts)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matmul = torch.ops.tandem.block_matmul.default
        if x.dim() == 2 and x.dtype == torch.float32:  # the model's own calls: no reshaping
            return matmul(x.contiguous(), self.codes, self.scale, self.minimum, self.bits)
        flat = x.reshape(-1, self.in_features).float().contiguous()  # (tokens, K)
        out = matmul(flat, self.codes, self.scale, self.minimum, self.bits)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def gather_codes(model: nn.Module) -> int:
    """Move every CodesLinear's tensors into one buffer, in the order the forward pass reads
    them, on huge pages; returns its size in bytes.

    A one-row step streams each weight from memory once: from one buffer on huge pages there
    are fewer TLB misses, and one stream the prefetcher follows from layer to layer.
    """
    owners = [
        (layer, name)
        for layer in model.modules()
        if isinstance(layer, CodesLinear)
        for name in ("codes", "scale", "minimum")
    ]

    def aligned(t: torch.Tensor) -> int:  # each tensor starts on a cache line
        return -(-t.nbytes // 64) * 64

    buffer = huge_page_buffer(
        sum(aligned(getattr(layer, name)) for layer, name in owners), "the weights"
    )
    offset = 0
    for layer, name in owners:
        tensor = getattr(layer, name)
        view = buffer[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        setattr(layer, name, view)
        offset += aligned(tensor)
    return offset
