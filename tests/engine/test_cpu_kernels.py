"""The native CPU kernels against PyTorch computing the same thing, and their refusals of bad
input (an error naming the problem, never a crash or a read outside the pool)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants

from engine import cpu_kernels
from engine.attention import build_metadata
from engine.codes_linear import CodesLinear
from engine.quant import q4_blocks, q8_0_as_q4_pair
from engine.rope import apply_rope

pytestmark = pytest.mark.skipif(
    not cpu_kernels.supported(), reason="the native CPU kernels need x86-64 with AVX-512 VNNI"
)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_kernels.load(), "the CPU supports the kernels, so they must build"


def relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    return float((ours - expected).abs().max() / expected.abs().max())


def gguf_parts(kind: Q, n: int, k: int, seed: int):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), kind)
    if kind == Q.Q8_0:
        return q8_0_as_q4_pair(raw, (n, k))
    return (q4_blocks(raw, kind, (n, k)),)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 33])
def test_codes_linear_equals_the_dequantized_weight(kind: Q, rows: int) -> None:
    """Activations are rounded to int8 per block of 32 (as llama.cpp's): an error of ~1%."""
    n, k = 48, 96
    parts = gguf_parts(kind, n, k, rows)
    layer = CodesLinear(*parts)
    weight = sum(p.dequantize() for p in parts)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    ours, expected = layer(x), x @ weight.T
    assert ours.shape == (rows, n)
    assert relative_error(ours, expected) <= 2e-2
    # Leading dimensions and other dtypes go through the same kernel.
    other = layer(x.view(1, rows, k).bfloat16())
    assert other.shape == (1, rows, n) and other.dtype == torch.bfloat16
    assert relative_error(other.float()[0], expected) <= 3e-2


def test_codes_linear_refuses_a_wrong_width() -> None:
    layer = CodesLinear(*gguf_parts(Q.Q4_1, 16, 64, 0))
    with pytest.raises(RuntimeError, match="activations have 96 features; the weight takes 64"):
        layer(torch.randn(2, 96))


def test_add_rms_norm_equals_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(5, 200, generator=gen), torch.randn(5, 200, generator=gen)
    weight = torch.randn(200, generator=gen)
    normed, summed = torch.ops.tandem.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.allclose(summed, x + residual)
    expected = F.rms_norm(x + residual, (200,), weight, 1e-5)
    assert torch.allclose(normed, expected, atol=1e-5)


def test_silu_mul_equals_torch() -> None:
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(torch.ops.tandem.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5)


def test_rope_and_store_equals_torch() -> None:
    t, heads, kv, hd = 3, 4, 2, 64
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, heads + 2 * kv, hd, generator=gen)
    angles = torch.rand(t, hd // 2, generator=gen) * 10
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    pool = torch.zeros(10, 2, kv, hd)
    slots = torch.tensor([7, 2, 5])
    expected = qkv.clone()
    expected[:, : heads + kv] = apply_rope(expected[:, : heads + kv], cos, sin)
    torch.ops.tandem.rope_and_store(qkv, cos, sin, pool, slots, heads, kv)
    assert torch.allclose(qkv, expected, atol=1e-5)
    assert torch.equal(pool[slots], qkv[:, heads:].reshape(t, 2, kv, hd))
    assert pool[[0, 1, 3, 4, 6, 8, 9]].abs().sum() == 0


def test_rope_and_store_refuses_a_slot_outside_the_pool() -> None:
    qkv, trig = torch.randn(1, 4, 64), torch.randn(1, 64)
    pool = torch.zeros(4, 2, 1, 64)
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.tandem.rope_and_store(qkv, trig, trig, pool, torch.tensor([4]), 2, 1)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_decode_equals_gathered_attention(hd: int, block_size: int) -> None:
    """Sequences of different lengths, over scattered blocks, with partial last blocks."""
    heads, kv = 6, 2
    lengths = [2, block_size, block_size + 1, 70]  # a decode has one key before its own
    gen = torch.Generator().manual_seed(hd + block_size)
    order = torch.randperm(60, generator=gen).tolist()  # blocks handed out out of order
    tables, used = [], 0
    for n in lengths:
        need = -(-n // block_size)
        tables.append(order[used : used + need])
        used += need
    pool = torch.randn(60 * block_size, 2, kv, hd, generator=gen)
    q = torch.randn(len(lengths), heads, hd, generator=gen)
    starts = [n - 1 for n in lengths]
    kernel = cpu_kernels.PagedDecode(block_size)
    gather = build_metadata(starts, [1] * len(lengths), tables, block_size, torch.device("cpu"))
    native = build_metadata(
        starts, [1] * len(lengths), tables, block_size, torch.device("cpu"), kernel
    )
    assert gather.decodes is not None and native.decodes is not None
    expected = gather.decodes.attend(q, pool)
    assert torch.allclose(native.decodes.attend(q, pool), expected, atol=1e-5)


def test_paged_decode_refuses_a_block_outside_the_pool() -> None:
    pool, q = torch.randn(32, 2, 1, 64), torch.randn(1, 2, 64)
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.tandem.paged_decode(q, pool, torch.tensor([[0, 2]]), torch.tensor([20]), 16)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        torch.ops.tandem.paged_decode(q, pool, torch.tensor([[0]]), torch.tensor([17]), 16)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_prefill_rows_equal_decodes_at_their_positions_bit_for_bit(
    hd: int, block_size: int
) -> None:
    """A step of prompts (whole, chunks after cached positions, one of more than 64 rows so
    that rows share spans and pieces split it) and a decode: each row is what paged_decode
    computes for a query at that position, exactly, and close to causal SDPA."""
    heads, kv = 6, 2
    spans = [(0, 150), (37, 29), (64, 1), (5, 70)]  # (first position, rows) of each sequence
    gen = torch.Generator().manual_seed(hd * block_size)
    order = torch.randperm(200, generator=gen).tolist()
    tables, used = [], 0
    for start, length in spans:
        need = -(-(start + length) // block_size)
        tables.append(order[used : used + need])
        used += need
    pool = torch.randn(200 * block_size, 2, kv, hd, generator=gen)
    q = torch.randn(sum(n for _, n in spans), heads, hd, generator=gen)
    starts, lengths = [s for s, _ in spans], [n for _, n in spans]
    meta = build_metadata(
        starts, lengths, tables, block_size, torch.device("cpu"),
        cpu_kernels.PagedDecode(block_size), cpu_kernels.PagedPrefill(block_size),
    )  # fmt: skip
    assert meta.rowwise is not None
    rows = meta.rowwise.attend(q, pool)
    decode = cpu_kernels.PagedDecode(block_size)
    row = 0
    for (start, length), table in zip(spans, tables, strict=True):
        padded = torch.tensor([table] * length)
        positions = torch.arange(start + 1, start + length + 1)
        as_decodes = decode(q[row : row + length], pool, padded, positions)
        assert torch.equal(rows[row : row + length], as_decodes)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(start + length)])  # fmt: skip
        keys, values = pool[slots, 0].transpose(0, 1), pool[slots, 1].transpose(0, 1)
        mask = torch.arange(start + length)[None, :] <= positions[:, None] - 1
        expected = F.scaled_dot_product_attention(
            q[row : row + length].transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True
        ).transpose(0, 1)
        assert torch.allclose(rows[row : row + length], expected, atol=1e-5)
        row += length


def test_paged_prefill_refuses_rows_its_sequences_do_not_have() -> None:
    pool, q = torch.randn(32, 2, 1, 64), torch.randn(3, 2, 64)
    tables, starts = torch.tensor([[0, 1]]), torch.tensor([0])
    with pytest.raises(RuntimeError, match="q has 3 rows, the sequences 2"):
        torch.ops.tandem.paged_prefill(q, pool, tables, starts, torch.tensor([2]), 16)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        torch.ops.tandem.paged_prefill(q, pool, tables, torch.tensor([30]), torch.tensor([3]), 16)
    with pytest.raises(RuntimeError, match="outside the pool"):  # positions 14-16: blocks 0, 2
        torch.ops.tandem.paged_prefill(
            q, pool, torch.tensor([[0, 2]]), torch.tensor([14]), torch.tensor([3]), 16
        )


def test_a_lock_left_by_a_killed_process_does_not_stop_the_next_load(tmp_path: Path) -> None:
    """torch's build lock is a file: a worker killed while it held it used to leave every later
    worker waiting on it forever. A copy of this machine's build, with such a file in it, loads."""
    from torch.utils import cpp_extension

    built_dir = Path(cpp_extension._get_build_directory(cpu_kernels.kernel_name(), verbose=False))
    copy = tmp_path / built_dir.name
    shutil.copytree(built_dir, copy)
    (copy / "lock").touch()  # what a process killed while holding torch's lock leaves
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    code = "from engine import cpu_kernels; print(cpu_kernels.load())"
    # The bound is for a hang, never a speed: the copy is already built, loading takes seconds.
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "True", done.stderr[-2000:]
    assert not (copy / "lock").exists()


@pytest.mark.parametrize("vocab", [49152, 327])  # whole vectors, and a ragged tail
@pytest.mark.parametrize("top_n", [0, 1, 5])
def test_score_rows_equals_pytorch(vocab: int, top_n: int) -> None:
    from engine.prompt_scores import score_rows

    gen = torch.Generator().manual_seed(vocab + top_n)
    logits = 4 * torch.randn(37, vocab, generator=gen)
    logits[3, :] = 1.0  # every token tied: rank 1, the lowest ids first
    logits[4, 100] = 60.0  # one far ahead of the rest
    targets = torch.randint(0, vocab, (37,), generator=gen)
    targets[4] = 100
    lp, ranks, ids, top = torch.ops.tandem.score_rows(logits, targets, top_n)
    want_lp, want_ranks, want_ids, want_top = score_rows(logits, targets, top_n)
    assert torch.allclose(lp, want_lp, atol=1e-5)
    assert torch.equal(ranks, want_ranks)
    assert torch.allclose(top, want_top, atol=1e-5)
    untied = [r for r in range(37) if r != 3]
    assert torch.equal(ids[untied], want_ids[untied])
    assert ids[3].tolist() == list(range(top_n))
    assert (int(ranks[4]), float(lp[4])) == (1, pytest.approx(0.0, abs=1e-6))


def test_score_rows_refuses_a_target_outside_the_vocabulary() -> None:
    with pytest.raises(RuntimeError, match="target 10 is outside the vocabulary"):
        torch.ops.tandem.score_rows(torch.zeros(2, 10), torch.tensor([1, 10]), 1)
    with pytest.raises(RuntimeError, match="one target per row"):
        torch.ops.tandem.score_rows(torch.zeros(2, 10), torch.tensor([1]), 1)
