"""Decode attention straight from the paged KV pool (Triton), split over the context.

One query token per sequence. Program (b, h, s) takes sequence b, KV head h (and the GQA group
of query heads that share it), and the s-th partition of the context: PART_BLOCKS blocks read
through the block table. Each partition leaves an unnormalised partial result with its running
max and sum (flash-decoding); `combine` merges the partitions. Shapes are fixed by the batch
size and `max_partitions`, not by the contexts, so the launch can be captured in a CUDA graph:
partitions past a sequence's end do no work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _partial(
    q_ptr,
    pool_ptr,
    tables_ptr,
    ctx_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_slot,
    stride_kv,
    stride_ph,
    stride_tb,
    stride_ab,
    stride_ah,
    stride_as,
    stride_mb,
    stride_mh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    PART_BLOCKS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g
    hmask = g < GROUP
    d = tl.arange(0, D)
    m_out = m_ptr + b * stride_mb + heads * stride_mh + s
    l_out = l_ptr + b * stride_mb + heads * stride_mh + s
    first = s * PART_BLOCKS * BLOCK
    if first >= ctx:
        # Nothing of this sequence here: a partial that the combine weighs at zero.
        tl.store(m_out, tl.full([GROUP_PAD], float("-inf"), tl.float32), mask=hmask)
        tl.store(l_out, tl.zeros([GROUP_PAD], tl.float32), mask=hmask)
        return
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=hmask[:, None],
        other=0.0,
    )  # (GROUP_PAD, D)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    offs = tl.arange(0, BLOCK)
    for j in range(PART_BLOCKS):
        index = s * PART_BLOCKS + j
        tok = index * BLOCK + offs
        valid = tok < ctx
        block_id = tl.load(tables_ptr + b * stride_tb + index, mask=index * BLOCK < ctx, other=0)
        slot = block_id.to(tl.int64) * BLOCK + offs
        base = pool_ptr + slot[:, None] * stride_slot + kvh * stride_ph + d[None, :]
        k = tl.load(base, mask=valid[:, None], other=0.0)  # (BLOCK, D)
        v = tl.load(base + stride_kv, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (GROUP_PAD, BLOCK)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc_ptr + b * stride_ab + heads[:, None] * stride_ah + s * stride_as + d[None, :]
    tl.store(out, acc, mask=hmask[:, None])
    tl.store(m_out, m_i, mask=hmask)
    tl.store(l_out, l_i, mask=hmask)


class PagedDecode:
    """Buffers for one batch-size bucket, reused step after step (and by CUDA graphs)."""

    def __init__(
        self,
        batch: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_context: int,
        device: torch.device,
        part_blocks: int = 16,
    ) -> None:
        self.group = n_heads // n_kv_heads
        self.block_size = block_size
        self.part_blocks = part_blocks
        self.partitions = -(-max_context // (block_size * part_blocks))
        shape = (batch, n_heads, self.partitions)
        self.acc = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)
        self.m = torch.empty(shape, dtype=torch.float32, device=device)
        self.l = torch.empty(shape, dtype=torch.float32, device=device)

    def __call__(
        self, q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor
    ) -> torch.Tensor:
        """q: (B, n_heads, hd); pool: (slots, 2, n_kv, hd); tables: (B, max_blocks) int32;
        context_lens: (B,) int32, each >= 1. Returns (B, n_heads, hd) in q's dtype."""
        b, _, hd = q.shape
        n_kv = pool.shape[2]
        grid = (b, n_kv, self.partitions)
        acc, maxes, sums = self.acc[:b], self.m[:b], self.l[:b]
        _partial[grid](
            q,
            pool,
            tables,
            context_lens,
            acc,
            maxes,
            sums,
            hd**-0.5,
            q.stride(0),
            q.stride(1),
            pool.stride(0),
            pool.stride(1),
            pool.stride(2),
            tables.stride(0),
            acc.stride(0),
            acc.stride(1),
            acc.stride(2),
            maxes.stride(0),
            maxes.stride(1),
            GROUP=self.group,
            GROUP_PAD=max(16, triton.next_power_of_2(self.group)),
            D=hd,
            BLOCK=self.block_size,
            PART_BLOCKS=self.part_blocks,
        )
        return combine(acc, maxes, sums).to(q.dtype)


def combine(acc: torch.Tensor, maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Merge partitions: acc (B, H, S, D) unnormalised, maxes and sums (B, H, S) → (B, H, D)."""
    top = maxes.amax(dim=-1, keepdim=True)  # (B, H, 1)
    weight = torch.exp(maxes - top)  # (B, H, S); empty partitions weigh exp(-inf) = 0
    total = (weight * sums).sum(dim=-1)  # (B, H)
    return (weight[..., None] * acc).sum(dim=-2) / total[..., None]
