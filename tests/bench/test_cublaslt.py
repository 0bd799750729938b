"""bench/cublaslt.py: every algorithm the heuristic offers computes the product torch does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m", [16, 64, 256])
def test_every_offered_algorithm_computes_the_product(m: int) -> None:
    from bench import cublaslt

    torch.manual_seed(0)
    n, k = 1024, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    want = F.linear(x, w).float()
    algorithms = cublaslt.algorithms(m, n, k)
    assert algorithms
    for algo in algorithms:
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        cublaslt.Product(m, n, k, algo)(x, w, out)
        assert (out.float() - want).abs().max() <= 0.02 * want.abs().max()
    with pytest.raises(ValueError, match="aligned"):  # a view 8 bytes in
        wide = torch.empty(m * k + 4, device="cuda", dtype=torch.bfloat16)
        cublaslt.Product(m, n, k)(wide[4:].view(m, k), w, out)
