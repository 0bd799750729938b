"""Causal attention of a prompt's tokens over the sequence's keys (Triton), GQA's shared heads read
as they are: a whole prompt's prefill, or a chunk that continues one.

Flash attention's forward pass: program (h, m) takes query head h and the m-th BLOCK_M queries,
and walks the keys BLOCK_N at a time keeping a running max and sum (the scores never reach
memory). For long prompts a program's BLOCK_M rows are PACK query heads of one GQA group
(BLOCK_M / PACK queries each): each K/V tile is loaded once for all of them. Keys wholly
before the block's first query need no mask; only the keys of the block's own span (the
diagonal) are masked. Programs of the last query blocks, which see the most keys, are launched
first, so the long ones do not form the tail. Exponentials in base 2 with the scale folded in
(one multiply a score).

The prompt's length is a plain argument, not a specialisation: one compiled kernel serves every
length, so no new prompt length compiles anything or builds a plan (cuDNN's attention builds one
for every new length: bench/RESULTS-gpu.md).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, warps, stages, PACK). 64 queries of one head by 64 keys, 4 warps, 3 stages:
# the best of the tile choices at 512 tokens for head sizes 64 and 128, within 3% of the best at
# 768-1,536 (bench/prefill_attention.py).
TILES = (64, 64, 4, 3, 1)
# Heads of 128 in GQA groups of a multiple of 4, where that makes LONG programs or more: 64
# queries of 4 heads that share a KV head, so each K/V tile read from L2 serves 4 heads' rows.
# LLaMA-3-8B's heads: 9% faster at 2,048 queries (256 programs), 10% at 4,096, 15% at 8,192;
# fewer programs leave SMs idle (1.5× slower at 1,024 queries, 128 programs).
LONG_TILES, LONG = (256, 64, 8, 3, 4), 256
_LOG2E = 1.4426950408889634


@triton.jit
def _step(
    q, k_ptrs, v_ptrs, kv0, ctx, qk_scale, pos, m_i, l_i, acc, stride_kt, stride_vt,
    DIAGONAL: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The running max, sum and output after BLOCK_N more keys from kv0; on the diagonal the
    keys past a query (or past the context) are masked."""
    if DIAGONAL:
        cols = kv0 + tl.arange(0, BLOCK_N)
        kmask = (cols < ctx)[:, None]
        k = tl.load(k_ptrs + kv0 * stride_kt, mask=kmask, other=0.0)
        v = tl.load(v_ptrs + kv0 * stride_vt, mask=kmask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(pos[:, None] >= cols[None, :], s, float("-inf"))
    else:
        k = tl.load(k_ptrs + kv0 * stride_kt)
        v = tl.load(v_ptrs + kv0 * stride_vt)
        s = tl.dot(q, tl.trans(k)) * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit(do_not_specialize=["L", "P"])
def _prefill_attention(
    q_ptr, k_ptr, v_ptr, o_ptr, L, P, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, PACK: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Rows r of the tile: query head (program 0) * PACK + r // TQ, query TQ * m + r % TQ.
    TQ: tl.constexpr = BLOCK_M // PACK
    m = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest rows first
    r = tl.arange(0, BLOCK_M)
    head = tl.program_id(0) * PACK + r // TQ
    kvh = tl.program_id(0) * PACK // GROUP
    rows = m * TQ + r % TQ
    pos = P + rows  # the queries' positions: each sees the keys up to its own
    ctx = P + L
    d = tl.arange(0, D)
    rmask = rows < L
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None], other=0.0)  # fmt: skip
    kn = tl.arange(0, BLOCK_N)
    k_ptrs = k_ptr + kvh * stride_kh + kn[:, None] * stride_kt + d[None, :]
    v_ptrs = v_ptr + kvh * stride_vh + kn[:, None] * stride_vt + d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # Whole tiles of keys before the block's first query need no mask; the rest are masked.
    start = (P + m * TQ) // BLOCK_N * BLOCK_N
    for kv0 in range(0, start, BLOCK_N):
        m_i, l_i, acc = _step(q, k_ptrs, v_ptrs, kv0, ctx, qk_scale, pos, m_i, l_i, acc,
                              stride_kt, stride_vt, False, BLOCK_N)  # fmt: skip
    for kv0 in range(start, tl.minimum(P + (m + 1) * TQ, ctx), BLOCK_N):  # the diagonal
        m_i, l_i, acc = _step(q, k_ptrs, v_ptrs, kv0, ctx, qk_scale, pos, m_i, l_i, acc,
                              stride_kt, stride_vt, True, BLOCK_N)  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(o_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])  # fmt: skip


def fits(q: torch.Tensor) -> bool:
    """Whether q (T, n_heads, hd) can take this kernel: a power-of-two head size of 16 to 128
    (wider heads would need smaller tiles than those measured)."""
    hd = q.shape[-1]
    return 16 <= hd <= 128 and hd & (hd - 1) == 0


def measured_tiles(
    length: int, heads: int, kv_heads: int, hd: int
) -> tuple[int, int, int, int, int]:
    """The tiles for `length` queries of `heads` over `kv_heads` heads of `hd`: LONG_TILES where
    their programs (4 heads of a group, 64 queries each) number LONG or more, else TILES."""
    pack = LONG_TILES[4]
    programs = heads // pack * triton.cdiv(length, LONG_TILES[0] // pack)
    long = hd == 128 and (heads // kv_heads) % pack == 0 and programs >= LONG
    return LONG_TILES if long else TILES


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """q: (L, n_heads, hd), the queries of positions ctx - L to ctx - 1; k, v: (ctx, n_kv, hd),
    the sequence's keys and values from position 0 (last dims contiguous). Returns causal
    attention (L, n_heads, hd), written into `out` where given. `tiles`: (BLOCK_M, BLOCK_N,
    warps, stages, PACK) instead of the measured choice: BLOCK_M rows of PACK query heads that
    share a KV head, BLOCK_M / PACK queries each, a program (PACK a power of two dividing the
    GQA group, else 1)."""
    length, heads, hd = q.shape
    ctx, kv_heads = k.shape[:2]
    assert heads % kv_heads == 0 and k.shape == v.shape == (ctx, kv_heads, hd) and ctx >= length
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    group = heads // kv_heads
    block_m, block_n, warps, stages, pack = tiles or measured_tiles(length, heads, kv_heads, hd)
    if group % pack or block_m % pack:
        pack = 1
    grid = (heads // pack, triton.cdiv(length, block_m // pack))
    _prefill_attention[grid](
        q, k, v, out, length, ctx - length, _LOG2E / math.sqrt(hd),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, PACK=pack, D=hd, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
