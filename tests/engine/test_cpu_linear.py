"""The CPU projections: oneDNN-packed weights, and int4 weights with their many-rows copy, give
the product of the weights they were built from, at every row count the engine uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants

from engine.cpu_linear import PackedLinear, pack_linears, packing_supported
from engine.quant import INT4_MAX_ROWS, Int4Linear, q4_blocks

N, K = 96, 128


def relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    return float((ours - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 200])
def test_packed_linear_equals_plain_product(dtype: torch.dtype, rows: int) -> None:
    if not packing_supported(dtype):
        pytest.skip(f"oneDNN cannot multiply {dtype} on this CPU")
    torch.manual_seed(rows)
    weight, x = torch.randn(N, K), torch.randn(2, rows, K)
    out = PackedLinear(weight, dtype)(x)
    assert out.shape == (2, rows, N) and out.dtype == torch.float32
    expected = F.linear(x.to(dtype).float(), weight.to(dtype).float())
    assert relative_error(out, expected) <= (1e-5 if dtype == torch.float32 else 1e-2)


@torch.no_grad()
def test_pack_linears_swaps_only_bias_free_linears() -> None:
    if not packing_supported(torch.float32):
        pytest.skip("no oneDNN in this torch build")
    model = torch.nn.Sequential(
        torch.nn.Linear(K, N, bias=False), torch.nn.ReLU(), torch.nn.Linear(N, 8, bias=True)
    )
    x = torch.randn(3, K)
    expected = model(x)
    assert pack_linears(model, torch.float32) == 1
    assert isinstance(model[0], PackedLinear) and type(model[2]) is torch.nn.Linear
    assert relative_error(model(x), expected) <= 1e-5


@pytest.mark.parametrize("rows", [1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 64])
def test_int4_linear_both_paths_equal_the_dequantized_weight(rows: int) -> None:
    """Few rows take the int4 kernel, more take the bf16 copy: both are the Q4_1 weight."""
    rng = np.random.default_rng(rows)
    raw = quants.quantize(rng.standard_normal((N, K)).astype(np.float32), Q.Q4_1)
    blocks = q4_blocks(raw, Q.Q4_1, (N, K))
    layer = Int4Linear(blocks)
    x = torch.from_numpy(rng.standard_normal((rows, K)).astype(np.float32))
    expected = F.linear(x.bfloat16().float(), blocks.dequantize())
    assert relative_error(layer(x), expected) <= 1e-2
