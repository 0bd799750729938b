"""GGUF's quantized weights kept quantized, parsed; and served through torch's int4 matmul on CPUs
where tandem's native kernels (engine/codes_linear.py) cannot be built.

A Q4_1 block of 32 weights stores a scale d, a minimum m and 32 four-bit codes q: w = d*q + m.
torch's CPU int4 kernel computes w = (q - 8) * scale + zero per group of 32 along the input
dimension, so scale = d and zero = m + 8d reproduce Q4_1 (Q4_0: w = d*(q - 8), zero = 0).
A Q8_0 block (w = d*q, q an int8) is two such matrices: q = 16*hi + lo with hi in [-8, 7] and
lo in [0, 15], so w = (hi+8 - 8)*16d + (lo - 8)*d + 8d — two int4 products summed, exactly.

The kernel is fast only with bf16 activations (on this CPU, 30× faster than fp32 ones), so the
matmul inputs are rounded to bf16 and the outputs come back in the caller's dtype; the scales
are bf16 too. The model never sees any of this: these modules stand in for `nn.Linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from torch import nn

from engine.cpu_linear import PackedLinear, packing_supported
from engine.errors import InvalidRequest

GROUP = 32  # GGUF's Q4 block size, and the int4 kernel's group size


@dataclass
class Q4Blocks:
    """A weight matrix (N out, K in) as 4-bit codes with a scale and a zero point per group."""

    codes: torch.Tensor  # (N, K) int32 in [0, 15]
    scales: torch.Tensor  # (N, K // GROUP) float32
    zeros: torch.Tensor  # (N, K // GROUP) float32: w = (code - 8) * scale + zero

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def rows(self, order: torch.Tensor) -> Q4Blocks:
        return Q4Blocks(self.codes[order], self.scales[order], self.zeros[order])

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        groups = (self.codes.view(n, k // GROUP, GROUP).float() - 8) * self.scales[..., None]
        return (groups + self.zeros[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[Q4Blocks]) -> Q4Blocks:
        return Q4Blocks(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.zeros for p in parts]),
        )


def q4_blocks(raw: np.ndarray, kind: Q, shape: tuple[int, int]) -> Q4Blocks:
    """GGUF Q4_0/Q4_1 bytes of a (N, K) matrix as codes, scales and zero points."""
    n, k = shape
    header = 4 if kind == Q.Q4_1 else 2
    blocks = np.ascontiguousarray(raw).reshape(n * k // GROUP, header + GROUP // 2)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    packed = blocks[:, header:]
    # Byte j holds code j in its low nibble and code j + 16 in its high nibble.
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.int32)
    if kind == Q.Q4_1:
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        zeros = m + 8 * d
    else:
        zeros = np.zeros_like(d)
    return Q4Blocks(
        torch.from_numpy(codes.reshape(n, k)),
        torch.from_numpy(d.reshape(n, k // GROUP)),
        torch.from_numpy(zeros.reshape(n, k // GROUP)),
    )


def q8_0_as_q4_pair(raw: np.ndarray, shape: tuple[int, int]) -> tuple[Q4Blocks, Q4Blocks]:
    """GGUF Q8_0 bytes of a (N, K) matrix as a high and a low 4-bit matrix that sum to it."""
    n, k = shape
    blocks = np.ascontiguousarray(raw).reshape(n * k // GROUP, 2 + GROUP)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # (blocks, 1)
    q = blocks[:, 2:].view(np.int8).astype(np.int32)  # (blocks, 32)
    hi, lo = q >> 4, q & 0x0F  # arithmetic shift: q = 16 * hi + lo, hi in [-8, 7]
    scales = d.reshape(n, k // GROUP)
    high = Q4Blocks(
        torch.from_numpy((hi + 8).reshape(n, k)),
        torch.from_numpy(16 * scales),
        torch.zeros(n, k // GROUP),
    )
    low = Q4Blocks(
        torch.from_numpy(lo.reshape(n, k)),
        torch.from_numpy(scales.copy()),
        torch.from_numpy(8 * scales),
    )
    return high, low


def int4_supported(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu")


# Up to this many rows the int4 kernel wins; its cost grows linearly with the rows (it reuses
# nothing across them), so larger batches and prefill take a bf16 copy of the same weights,
# packed for oneDNN where the CPU multiplies bf16 natively.
INT4_MAX_ROWS = 8


class Int4Linear(nn.Module):
    """A linear layer whose weight is one int4 matrix (Q4_0/Q4_1) or a sum of two (Q8_0)."""

    many_rows: nn.Module  # the same (N, K) weight in bf16, for many rows at once
    packed0: torch.Tensor  # (N, K / 2) uint8 codes in the kernel's layout
    scales_and_zeros0: torch.Tensor  # (K / GROUP, N, 2) bf16
    packed1: torch.Tensor  # the second matrix of a Q8_0 weight
    scales_and_zeros1: torch.Tensor

    def __init__(self, *parts: Q4Blocks) -> None:
        super().__init__()
        self.out_features, self.in_features = parts[0].shape
        self.num_parts = len(parts)
        dense = torch.as_tensor(sum(p.dequantize() for p in parts)).to(torch.bfloat16)
        if packing_supported(torch.bfloat16):
            self.many_rows = PackedLinear(dense, torch.bfloat16)
        else:
            self.many_rows = nn.Linear(self.in_features, self.out_features, bias=False)
            self.many_rows.weight = nn.Parameter(dense, requires_grad=False)
        for i, blocks in enumerate(parts):
            # inner_k_tiles=1 is the CPU kernel's layout: the packed tensor is (N, K / 2) uint8.
            packed = torch._convert_weight_to_int4pack_for_cpu(blocks.codes, 1)
            scales_and_zeros = torch.stack([blocks.scales, blocks.zeros], dim=-1)  # (N, K/G, 2)
            self.register_buffer(f"packed{i}", packed)
            self.register_buffer(
                f"scales_and_zeros{i}", scales_and_zeros.transpose(0, 1).contiguous().bfloat16()
            )

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """The kernel's packing wants rows in multiples of 16 and whole groups per row."""
        return out_features % 16 == 0 and in_features % GROUP == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (tokens, K)
        if flat.shape[0] > INT4_MAX_ROWS:
            return self.many_rows(flat).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        out = torch._weight_int4pack_mm_for_cpu(flat, self.packed0, GROUP, self.scales_and_zeros0)
        if self.num_parts == 2:
            out += torch._weight_int4pack_mm_for_cpu(
                flat, self.packed1, GROUP, self.scales_and_zeros1
            )
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """Weight-only int8 with one scale per output channel (symmetric): w ≈ q * scale.

    On CUDA small batches go through a Triton kernel that reads the int8 weight directly; on
    CPU through torch's int8 weight-only kernel; activations stay in the model's dtype (bf16).
    """

    weight: torch.Tensor  # (N, K) int8
    scale: torch.Tensor  # (N,)

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # (N,)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale.to(weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (tokens, K)
        if flat.is_cuda:
            from engine.kernels.w8a16 import SMALL_M, w8a16_matmul

            if flat.shape[0] <= SMALL_M:
                out = w8a16_matmul(flat, self.weight, self.scale)
            else:  # arithmetic-bound: widen once, let cuBLAS multiply
                out = F.linear(flat, self.weight.to(flat.dtype)) * self.scale
        else:
            out = torch._weight_int8pack_mm(
                flat.to(torch.bfloat16), self.weight, self.scale.to(torch.bfloat16)
            ).to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in e4m3, clamped first: out-of-range values would not saturate everywhere."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class Fp8Linear(nn.Module):
    """FP8 (e4m3) weights with one scale per output channel: w ≈ q * scale.

    Few rows (decode) are bound by reading the weights, so they stay weight-only: the int8
    kernel widens the fp8 tile in registers (half the bytes of bf16, like int8), and a batch-1
    graph reads them through the fused row kernels (engine/row_decode.py). More rows
    (prefill, large batches) are bound by arithmetic: each row's activations are scaled into e4m3
    by their own absolute maximum and the FP8 tensor cores multiply (`torch._scaled_mm`, row-wise
    scales), at twice bf16's rate on Hopper.
    """

    weight: torch.Tensor  # (N, K) float8_e4m3fn
    scale: torch.Tensor  # (N,) float32

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if not self.fits(*weight.shape):
            raise InvalidRequest(
                "quantize",
                f"fp8 needs dimensions in multiples of 16; a weight is {tuple(weight.shape)}",
            )
        scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX  # (N,)
        self.register_buffer("weight", to_fp8(weight, scale[:, None]))
        self.register_buffer("scale", scale)

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """The FP8 GEMM wants both dimensions in multiples of 16."""
        return out_features % 16 == 0 and in_features % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (tokens, K)
        if flat.is_cuda:
            from engine.kernels.fp8_rows import rows_to_fp8
            from engine.kernels.w8a16 import FP8_SMALL_M, w8a16_matmul

            if flat.shape[0] <= FP8_SMALL_M:
                return w8a16_matmul(flat, self.weight, self.scale).reshape(
                    *x.shape[:-1], self.out_features
                )
            codes, row_scale = rows_to_fp8(flat)
        else:
            row_scale = flat.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
            codes = to_fp8(flat, row_scale)
        out = torch._scaled_mm(
            codes,
            self.weight.t(),  # (K, N) column-major, as the GEMM wants its second operand
            scale_a=row_scale,
            scale_b=self.scale[None, :],
            out_dtype=torch.bfloat16,
        )
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def quantize_int8(model: nn.Module) -> int:
    """Swap every float projection (and the output head) for weight-only int8; returns how many."""
    swapped = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, Int8Linear(child.weight.detach()))
                swapped += 1
    return swapped
