"""Decode attention in one launch (Triton): RoPE on the new Q and K, the K/V store into the paged
pool, flash-decoding over the context, and the merge of its partitions.

engine/kernels/fused.py and engine/kernels/paged_decode.py do the same in three launches
(rope + store, partials, merge); in a one-row decode step each of those is a few microseconds of
an idle GPU, 32 times over. Here program (b, h, s) takes sequence b, KV head h with its GQA group
of query heads, and the s-th partition of the context, as paged_decode does, and also:

- computes the rotary angles of the new position (as Transformer.rope_tables does) and rotates
  the group's queries and the new key in registers;
- reads its partition's earlier keys and values in one gather (block ids, then rows), not
  block by block: two memory round trips instead of two a block, and both requested before it
  waits for the kernel before it (programmatic dependent launch), which never writes them;
- if its partition holds the new position, stores the new K and V into the pool and scores the
  new key from registers (the pool is read only for earlier positions, so no program reads what
  another writes);
- leaves its partial result in a workspace and bumps a counter: the last partition of (b, h) to
  arrive merges them all, 16 partitions a round, writes the output, and resets the counter
  (engine/kernels/merge.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.merge import merge_when_last
from engine.kernels.paged_kv import gather_kv


@triton.jit
def _rope_attention(
    qkv_ptr, inv_freq_ptr, pool_ptr, tables_ptr, ctx_ptr, slot_ptr,
    acc_ptr, m_ptr, l_ptr, counter_ptr, out_ptr, scale,
    stride_qb, stride_slot, stride_kv, stride_ph, stride_tb, stride_cb, stride_sb, stride_ob,
    H: tl.constexpr, KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PART: tl.constexpr,
    MAX_PARTS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    # The context length is an input of the step, not the previous kernel's output: programs
    # past the context leave before waiting for that kernel (most of them: the grid covers the
    # longest context).
    ctx = tl.load(ctx_ptr + b * stride_cb)
    parts = (ctx + PART - 1) // PART
    if s >= parts:
        return
    pos = ctx - 1  # the new token's position; the pool holds positions [0, pos)
    d = tl.arange(0, D)
    # Earlier steps wrote these keys and values, not the kernel before this one, and the block
    # table is an input of the step: requested before the wait, their latency hides behind that
    # kernel's tail (bench/RESULTS-gpu.md, session 38).
    k, v, valid = gather_kv(pool_ptr, tables_ptr, b, kvh, s * PART, pos, stride_slot, stride_kv,
                            stride_ph, stride_tb, D, BLOCK, PART,
                            pool_ptr.dtype.element_ty)  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dt = qkv_ptr.dtype.element_ty
    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g
    hmask = g < GROUP
    HALF: tl.constexpr = D // 2
    # Rotate-half RoPE: x' = x cos + (-x2, x1) sin, cos and sin rounded to the model's dtype.
    angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + d % HALF)
    cos = tl.cos(angle).to(dt).to(tl.float32)
    sin = tl.sin(angle).to(dt).to(tl.float32)
    partner = (d + HALF) % D
    sign = tl.where(d < HALF, -1.0, 1.0)
    row = qkv_ptr + b * stride_qb
    q_at = row + heads[:, None] * D
    q = tl.load(q_at + d[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    q_partner = tl.load(q_at + partner[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    q = (q * cos[None, :] + sign[None, :] * q_partner * sin[None, :]).to(dt)  # (GROUP_PAD, D)
    k_at = row + (H + kvh) * D
    k_new = tl.load(k_at + d).to(tl.float32) * cos + sign * tl.load(k_at + partner) * sin
    k_new = k_new.to(dt)
    v_new = tl.load(row + (H + KV + kvh) * D + d)
    last = s == parts - 1
    if last:
        slot = tl.load(slot_ptr + b * stride_sb)
        dest = pool_ptr + slot * stride_slot + kvh * stride_ph + d
        tl.store(dest, k_new)
        tl.store(dest + stride_kv, v_new)

    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (GROUP_PAD, PART)
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_i = tl.max(scores, 1)
    # A partition with no earlier key (the new token opens it) must not make NaNs.
    p = tl.exp(scores - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
    l_i = tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, input_precision="ieee")  # (GROUP_PAD, D)
    if last:  # the new key, scored from registers
        score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
        m_new = tl.maximum(m_i, score)
        p_new = tl.exp(score - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + p_new
        pv = p_new.to(dt).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    part_at = (b * H + heads) * MAX_PARTS
    tl.store(acc_ptr + (part_at + s)[:, None] * D + d[None, :], acc, mask=hmask[:, None])
    tl.store(m_ptr + part_at + s, m_i, mask=hmask)
    tl.store(l_ptr + part_at + s, l_i, mask=hmask)
    merge_when_last(counter_ptr + b * KV + kvh, acc_ptr, m_ptr, l_ptr, out_ptr + b * stride_ob,
                    b, kvh, parts, H, GROUP, GP, D, MAX_PARTS, CHUNK)  # fmt: skip


class RopeAttention:
    """Workspace for up to `batch` decode rows, reused step after step (and by CUDA graphs)."""

    def __init__(
        self,
        batch: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_context: int,
        device: torch.device,
        part_blocks: int = 4,
    ) -> None:
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv_heads, head_dim
        self.group = n_heads // n_kv_heads
        self.block_size, self.part_blocks = block_size, part_blocks
        self.max_parts = -(-max_context // (block_size * part_blocks))
        rows = batch * n_heads * self.max_parts
        self.acc = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
        self.m = torch.empty(rows, dtype=torch.float32, device=device)
        self.l = torch.empty(rows, dtype=torch.float32, device=device)
        self.counters = torch.zeros(batch * n_kv_heads, dtype=torch.int32, device=device)

    def __call__(
        self,
        qkv: torch.Tensor,
        inv_freq: torch.Tensor,
        pool: torch.Tensor,
        tables: torch.Tensor,
        context_lens: torch.Tensor,
        slots: torch.Tensor,
        pdl: bool = False,
    ) -> torch.Tensor:
        """qkv: (B, n_heads + 2 n_kv, hd) before RoPE, contiguous; inv_freq: (hd / 2,) fp32;
        pool: (slots, 2, n_kv, hd); tables: (B, max_blocks); context_lens: (B,), each >= 1,
        counting the new token; slots: (B,) where the new K/V go. Returns (B, n_heads, hd)."""
        b, heads, hd = qkv.shape
        assert heads == self.n_heads + 2 * self.n_kv and hd == self.head_dim
        assert qkv.stride(2) == 1 and qkv.stride(1) == hd
        out = torch.empty((b, self.n_heads, hd), dtype=qkv.dtype, device=qkv.device)
        _rope_attention[(b, self.n_kv, self.max_parts)](
            qkv, inv_freq, pool, tables, context_lens, slots,
            self.acc, self.m, self.l, self.counters, out, hd**-0.5,
            qkv.stride(0), pool.stride(0), pool.stride(1), pool.stride(2), tables.stride(0),
            context_lens.stride(0), slots.stride(0), out.stride(0),
            H=self.n_heads, KV=self.n_kv, GROUP=self.group,
            GROUP_PAD=max(16, triton.next_power_of_2(self.group)),
            GP=triton.next_power_of_2(self.group), D=hd, BLOCK=self.block_size,
            PART=self.block_size * self.part_blocks, MAX_PARTS=self.max_parts, CHUNK=16,
            PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
        return out
