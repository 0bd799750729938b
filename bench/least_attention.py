"""The least attention kernel that can sit between QKV and O in the batch-1 graph: what any
attention launch there costs, however it is written.

It does what engine/kernels/rope_attention.py's kernel cannot leave out of one launch: each program
(sequence, KV head, partition of 64 tokens) requests its keys and values before the
programmatic-dependent-launch wait (that kernel's own gather), then loads its heads' queries (the
wait is for them), takes the two products, and stores a normalized output. It leaves out RoPE, the
new token's K/V store and the merge of partitions: every partition writes the same output rows, so
the tokens are wrong. bench/batch1_tiles.py's `--least-attention` runs it in place of the real
kernel, beside `--without-attention` (no kernel at all): the difference between the two is the
launch's own price (bench/RESULTS-gpu.md, session 69).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from engine.kernels.paged_kv import gather_kv
from engine.kernels.rope_attention import RopeAttention


@triton.jit
def _least_attention(
    qkv_ptr, pool_ptr, tables_ptr, ctx_ptr, out_ptr, scale,
    stride_qb, stride_slot, stride_kv, stride_ph, stride_tb, stride_ob,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    PART: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    if s * PART >= ctx:
        return
    d = tl.arange(0, D)
    k, v, valid = gather_kv(pool_ptr, tables_ptr, b, kvh, s * PART, ctx - 1, stride_slot,
                            stride_kv, stride_ph, stride_tb, D, BLOCK, PART,
                            pool_ptr.dtype.element_ty)  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g
    hmask = g < GROUP
    q = tl.load(qkv_ptr + b * stride_qb + heads[:, None] * D + d[None, :], mask=hmask[:, None],
                other=0.0)  # fmt: skip
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (GROUP_PAD, PART)
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m = tl.max(scores, 1)
    p = tl.exp(scores - tl.where(m == float("-inf"), 0.0, m)[:, None])
    l_sum = tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    dest = out_ptr + b * stride_ob + heads[:, None] * D + d[None, :]
    tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


def least_call(
    self: RopeAttention, qkv: torch.Tensor, *tensors: torch.Tensor, pdl: bool = False
) -> torch.Tensor:
    """RopeAttention.__call__'s arguments (qkv, inv_freq, pool, tables, context_lens, slots),
    the least kernel launched on the same grid."""
    _, pool, tables, context_lens, _ = tensors
    b, _, hd = qkv.shape
    out = torch.empty((b, self.n_heads, hd), dtype=qkv.dtype, device=qkv.device)
    _least_attention[(b, self.n_kv, self.max_parts)](
        qkv, pool, tables, context_lens, out, hd**-0.5,
        qkv.stride(0), pool.stride(0), pool.stride(1), pool.stride(2), tables.stride(0),
        out.stride(0),
        GROUP=self.group, GROUP_PAD=max(16, triton.next_power_of_2(self.group)), D=hd,
        BLOCK=self.block_size, PART=self.block_size * self.part_blocks, PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return out


@contextmanager
def least_attention() -> Iterator[None]:
    """While the block runs, RopeAttention launches the least kernel instead of its own."""
    call = RopeAttention.__call__
    RopeAttention.__call__ = least_call  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        RopeAttention.__call__ = call  # type: ignore[method-assign]


def check_small() -> None:
    """In Triton's interpreter: with the context in one partition (where writing the output
    needs no merge) the least kernel is attention over the earlier positions, queries unrotated."""
    torch.manual_seed(0)
    heads, kv_heads, hd, bs = 8, 2, 16, 4
    attention = RopeAttention(1, heads, kv_heads, hd, bs, 64, torch.device("cpu"), part_blocks=4)
    for ctx in (2, 9, 16):
        pool = torch.randn(32, 2, kv_heads, hd)
        table = torch.randperm(8)[None, :]
        qkv = torch.randn(1, heads + 2 * kv_heads, hd)
        with least_attention():
            out = attention(qkv, torch.ones(hd // 2), pool, table, torch.tensor([ctx]),
                            torch.zeros(1, dtype=torch.int64))  # fmt: skip
        slots = table[0, torch.arange(ctx - 1) // bs] * bs + torch.arange(ctx - 1) % bs
        k, v = (pool[slots, i].repeat_interleave(heads // kv_heads, 1) for i in (0, 1))
        weights = torch.softmax(torch.einsum("hd,thd->ht", qkv[0, :heads], k) * hd**-0.5, -1)
        want = torch.einsum("ht,thd->hd", weights, v)
        err = float((out[0] - want).abs().max())
        print(f"least attention, context {ctx}: max error {err:.2e}")
        assert err < 1e-5, err
