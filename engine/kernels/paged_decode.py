"""Decode attention straight from the paged KV pool (Triton), split over the context.

One query token per sequence. Program (h, b, s) takes sequence b, KV head h (and the GQA group
of query heads that share it), and the s-th partition of the context: PART_BLOCKS blocks read
through the block table, TILE tokens (TILE / BLOCK blocks, each token's row found through its
block's id) a loop iteration. Each partition leaves an unnormalised partial result with its
running max and sum (flash-decoding), and the last of a sequence's partitions to finish merges
them (engine/kernels/merge.py), in the same launch. A context that fits in one partition is
written out by that partition itself.

`attend_new` also finishes the step's own token, which a decode-only step would otherwise hand
to a RoPE + K/V store kernel first (engine/kernels/fused.py): each program rotates its Q heads,
and the partition holding the new position rotates the new key and stores key and value into
the pool before its loop reads them back. One launch a layer fewer, and the same bits as the
two launches: RoPE written as fused.py writes it, the loop's sums in the same order.
Shapes are fixed by the batch size alone, not by the contexts, so the launches can be captured
in a CUDA graph: partitions past a sequence's end return at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.merge import merge_when_last
from engine.kernels.paged_kv import gather_kv


# Strides that differ between eager steps and graphs, or from step to step (the block tables'
# width), are plain arguments: one compiled kernel serves them all.
@triton.jit
def _rotated(row, d, cos, sin, mask, HALF: tl.constexpr, D: tl.constexpr):
    """RoPE (rotate-half) of the rows at row + d: x cos - x[d + HALF] sin in the first half,
    x cos + x[d - HALF] sin in the second, in fp32 and rounded to their dtype, written as
    engine/kernels/fused.py writes them, so the compiler fuses the same multiply-adds and the
    two kernels agree to the bit."""
    x = tl.load(row + d, mask=mask, other=0.0)
    own = x.to(tl.float32)
    partner = tl.load(row + (d + HALF) % D, mask=mask, other=0.0).to(tl.float32)
    return tl.where(d < HALF, own * cos - partner * sin, own * cos + partner * sin).to(x.dtype)


@triton.jit(do_not_specialize=["stride_tb", "stride_cb", "stride_rb", "stride_sb"])
def _partial(
    q_ptr, pool_ptr, tables_ptr, ctx_ptr, acc_ptr, m_ptr, l_ptr, counter_ptr, out_ptr, scale,
    cos_ptr, sin_ptr, slot_ptr,
    stride_qb, stride_qh, stride_slot, stride_kv, stride_ph, stride_tb, stride_cb, stride_ob,
    stride_rb, stride_sb,
    H: tl.constexpr, KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PART_BLOCKS: tl.constexpr,
    PARTS: tl.constexpr, TILE: tl.constexpr, DYNAMIC: tl.constexpr, KV_FP8: tl.constexpr,
    CHUNK: tl.constexpr, NEW: tl.constexpr, KV_LIMIT: tl.constexpr,
):  # fmt: skip
    # KV heads vary fastest in launch order: the programs of one sequence run side by side and
    # read its tokens' K/V rows together (1-2% faster at 256 sequences, bench/RESULTS-gpu.md).
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b * stride_cb)
    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g
    hmask = g < GROUP
    d = tl.arange(0, D)
    PART: tl.constexpr = PART_BLOCKS * BLOCK
    parts = tl.cdiv(ctx, PART)
    if s >= parts:
        return  # nothing of this sequence here
    row = q_ptr + b * stride_qb  # NEW: the step's Q/K/V row, Q and K not yet rotated
    if NEW:
        cos = tl.load(cos_ptr + b * stride_rb + d).to(tl.float32)
        sin = tl.load(sin_ptr + b * stride_rb + d).to(tl.float32)
        q = _rotated(row + heads[:, None] * stride_qh, d[None, :], cos[None, :], sin[None, :],
                     hmask[:, None], D // 2, D)  # fmt: skip
        if s == parts - 1:  # the new position is this partition's last: its K/V into the pool
            key = _rotated(row + (H + kvh) * stride_qh, d, cos, sin, d < D, D // 2, D)
            value = tl.load(row + (H + KV + kvh) * stride_qh + d)
            dest = pool_ptr + tl.load(slot_ptr + b * stride_sb) * stride_slot + kvh * stride_ph + d
            if KV_LIMIT > 0:  # an fp8 pool: values as they are (scale 1), saturated, as fused.py
                key = tl.clamp(key.to(tl.float32), -KV_LIMIT, KV_LIMIT)
                value = tl.clamp(value.to(tl.float32), -KV_LIMIT, KV_LIMIT)
            tl.store(dest, key.to(pool_ptr.dtype.element_ty))
            tl.store(dest + stride_kv, value.to(pool_ptr.dtype.element_ty))
            # Every thread of the program sees the stores before the loop reads the pool: the
            # new token is read back as the two-launch path reads it, so the sums are the same.
            tl.debug_barrier()
    else:
        q = tl.load(row + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
    if KV_FP8:  # e4m3 widens to fp16 in one instruction (to bf16 in several): products in fp16
        q = q.to(tl.float16)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    first = s * PART
    # DYNAMIC: only the tiles that hold some of the context; else static bounds, tiles past the
    # context masked.
    tiles = tl.cdiv(tl.minimum(ctx - first, PART), TILE) if DYNAMIC else PART // TILE
    for j in range(tiles):
        k, v, valid = gather_kv(pool_ptr, tables_ptr, b, kvh, first + j * TILE, ctx, stride_slot,
                                stride_kv, stride_ph, stride_tb, D, BLOCK, TILE,
                                q.dtype)  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (GROUP_PAD, TILE)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    if parts == 1:  # the context's only partition: this is the output
        out = out_ptr + b * stride_ob + heads[:, None] * D + d[None, :]
        tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:  # a partial for the last partition to finish to merge (engine/kernels/merge.py)
        part_at = (b * H + heads) * PARTS + s
        tl.store(acc_ptr + part_at[:, None] * D + d[None, :], acc, mask=hmask[:, None])
        tl.store(m_ptr + part_at, m_i, mask=hmask)
        tl.store(l_ptr + part_at, l_i, mask=hmask)
        merge_when_last(
            counter_ptr + b * KV + kvh, acc_ptr, m_ptr, l_ptr, out_ptr + b * stride_ob, b, kvh,
            parts, H, GROUP, GP, D, PARTS, CHUNK,
        )  # fmt: skip


@dataclass(frozen=True)
class Tiling:
    """How `_partial` walks a partition: tokens a loop iteration (a multiple of the block size),
    warps a program, and whether the loop stops at the context's end or runs the partition's
    whole length, masked."""

    tile: int
    warps: int = 4
    dynamic: bool = False
    stages: int = 3  # loop iterations whose loads are in flight at once (Triton's pipelining)


class PagedDecode:
    """Buffers for up to `batch` sequences, reused step after step (and by CUDA graphs).

    A small batch splits each context into short partitions, so many programs share one
    sequence (latency); a large batch gets long partitions, since the batch is parallelism
    enough and a long loop pipelines its loads. `part_blocks` and `tiling` fix those choices
    for every batch (tests and benchmarks compare them).
    """

    def __init__(
        self,
        batch: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_context: int,
        device: torch.device,
        part_blocks: int | None = None,
        tiling: Tiling | None = None,
        kv_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """kv_dtype: the pool's, which the default tiling depends on (any pool is read right)."""
        self.group = n_heads // n_kv_heads
        self.n_heads = n_heads
        self.kv_fp8 = kv_dtype == torch.float8_e4m3fn
        self.n_kv = n_kv_heads
        self.block_size = block_size
        self.max_context = max_context
        self.fixed_part_blocks = part_blocks
        self.fixed_tiling = tiling
        rows = max(b * self.partitions(b) for b in range(1, batch + 1))
        self.acc = torch.empty(rows * n_heads * head_dim, dtype=torch.float32, device=device)
        self.m = torch.empty(rows * n_heads, dtype=torch.float32, device=device)
        self.l = torch.empty(rows * n_heads, dtype=torch.float32, device=device)
        self.counters = torch.zeros(batch * n_kv_heads, dtype=torch.int32, device=device)

    def part_blocks(self, batch: int) -> int:
        if self.fixed_part_blocks is not None:
            return self.fixed_part_blocks
        # Long partitions pipeline their loads best; a batch of few (sequence, KV head) pairs
        # needs short ones to give every SM work. The fastest of bench/attention_tiles.py's
        # variants, timed inside CUDA graphs, at 8-256 sequences of 640 tokens and 16 of 4,096.
        return 8 if batch * self.n_kv < 128 else 64

    def tiling(self, batch: int) -> Tiling:
        if self.fixed_tiling is not None:
            return self.fixed_tiling
        if self.kv_fp8:
            # A token's e4m3 row is half the bytes: 128 tokens an iteration with two in flight,
            # and two warps a program where (sequence, KV head) pairs are many. 20-40% faster
            # than the bf16 pool's tiling at 8-256 sequences (bench/attention_tiles.py).
            return Tiling(max(128, self.block_size), 2 if batch * self.n_kv >= 512 else 4, True, 2)
        if batch * self.n_kv >= 128:
            # Many (sequence, KV head) pairs: two warps and two loads in flight a program, so
            # more programs fit an SM. Inside whole decode steps, where the card runs at its
            # power limit, 1-2% faster at 64-256 sequences than the tiling below, which
            # attention timed alone could not tell apart (bench/RESULTS-gpu.md, session 41).
            return Tiling(max(64, self.block_size), 2, True, 2)
        return Tiling(max(64, self.block_size), 4, True)

    def variant(self, batch: int) -> tuple[int, Tiling]:
        """What the kernel is compiled for at this batch size (the rest are plain arguments)."""
        return self.part_blocks(batch), self.tiling(batch)

    def partitions(self, batch: int) -> int:
        return -(-self.max_context // (self.block_size * self.part_blocks(batch)))

    def __call__(
        self, q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor
    ) -> torch.Tensor:
        """q: (B, n_heads, hd); pool: (slots, 2, n_kv, hd); tables: (B, max_blocks) block ids;
        context_lens: (B,), each >= 1 (any strides). Returns (B, n_heads, hd) in q's dtype."""
        return self._launch(q, pool, tables, context_lens, None)

    def attend_new(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        pool: torch.Tensor,
        tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """A decode-only step's attention, its own token included: qkv (B, n_heads + 2 n_kv, hd)
        as the QKV product left it (Q and K not rotated); cos, sin (B, hd) of each row's
        position (context_lens - 1), where `slots` (B,) say its K/V go. Rotates Q and K as
        engine/kernels/fused.py's rope_and_store would, stores K and V into the pool, and
        returns (B, n_heads, hd) as __call__ over the stored pool would."""
        b, heads, hd = qkv.shape
        assert heads == self.n_heads + 2 * self.n_kv and qkv.stride(2) == 1
        assert cos.shape == sin.shape == (b, hd) and cos.stride() == sin.stride()
        return self._launch(qkv, pool, tables, context_lens, (cos, sin, slots))

    def _launch(
        self,
        q: torch.Tensor,
        pool: torch.Tensor,
        tables: torch.Tensor,
        context_lens: torch.Tensor,
        new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        b, hd = q.shape[0], q.shape[2]
        n_heads = self.n_heads
        parts = self.partitions(b)
        part_blocks, tiling = self.part_blocks(b), self.tiling(b)
        tile = min(tiling.tile, part_blocks * self.block_size)
        out = torch.empty((b, n_heads, hd), dtype=q.dtype, device=q.device)  # heads contiguous
        cos, sin, slots = new if new is not None else (q, q, context_lens)
        fp8 = pool.dtype == torch.float8_e4m3fn
        _partial[(self.n_kv, b, parts)](
            q, pool, tables, context_lens, self.acc, self.m, self.l, self.counters, out,
            hd**-0.5, cos, sin, slots, q.stride(0), q.stride(1), pool.stride(0), pool.stride(1),
            pool.stride(2), tables.stride(0), context_lens.stride(0), out.stride(0),
            cos.stride(0), slots.stride(0),
            H=n_heads, KV=self.n_kv, GROUP=self.group,
            GROUP_PAD=max(16, triton.next_power_of_2(self.group)),
            GP=triton.next_power_of_2(self.group), D=hd, BLOCK=self.block_size,
            PART_BLOCKS=part_blocks, PARTS=parts, TILE=tile, DYNAMIC=tiling.dynamic,
            KV_FP8=fp8, num_warps=tiling.warps, num_stages=tiling.stages,
            CHUNK=16 if tiling.warps >= 4 else 8, NEW=new is not None,
            KV_LIMIT=torch.finfo(pool.dtype).max if pool.dtype.itemsize == 1 else 0.0,
        )  # fmt: skip
        return out
