"""bench/int8_activations.py's int8 × int8 (dp4a) row kernel against its torch reference, on the
CPU in Triton's interpreter (CI has no GPU; there shifts stand in for dp4a), and the inputs'
quantisation in groups."""

from __future__ import annotations

import torch
from interpreted import run_interpreted

from bench.int8_activations import quantize_groups

CHECK = """
import torch
from bench.int8_activations import quantize_groups, w8a8_gemv, w8a8_reference
torch.manual_seed(0)
n, k = 16, 256
w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
w.view(-1)[:256] = torch.arange(-128, 128, dtype=torch.int8)
scale = torch.rand(n) + 0.1
x = torch.randn(k)
for group in (8, 16, 32):
    xq, xs = quantize_groups(x, group)
    want = w8a8_reference(xq, xs, w, scale, group)
    for broadcast in (False, True):
        got = w8a8_gemv(xq, xs, w, scale, group=group, tile=(8, 128, 4), broadcast=broadcast)
        rel = float((got - want).abs().max() / want.abs().max())
        print(f"group {group}, broadcast {broadcast}: relative error {rel:.2e}")
        assert rel < 1e-5, rel  # exact integer sums; fp32 adds the groups in another order
    w8a8_gemv(xq, xs, w, scale, group=group, tile=(8, 128, 4), stream=True)
"""


def test_the_dp4a_kernel_equals_its_reference_in_the_interpreter() -> None:
    assert run_interpreted(CHECK).count("relative error") == 6


def test_inputs_are_quantised_to_half_a_step_of_their_group() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    x[5] = 40.0  # an outlier costs only its own group's precision
    for group in (8, 16, 32):
        q, scale = quantize_groups(x, group)
        assert q.dtype == torch.int8 and scale.shape == (4096 // group,)
        assert int(q.abs().max()) == 127
        error = (q.float().view(-1, group) * scale[:, None]).view(-1) - x
        assert bool((error.abs().view(-1, group) <= scale[:, None] / 2 + 1e-6).all())
        assert float(error[group:].abs().max()) < 0.02
