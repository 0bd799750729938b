"""Reading a sequence's keys and values out of the paged K/V pool (Triton), as the decode
attention kernels do: engine/kernels/paged_decode.py a tile at a time, engine/kernels/
rope_attention.py a partition before it waits for the kernel ahead of it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_kv(
    pool_ptr, tables_ptr, b, kvh, first, end, stride_slot, stride_kv, stride_ph, stride_tb,
    D: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """Sequence b's keys and values of KV head kvh at positions first .. first + TOKENS,
    (TOKENS, D) each, in one gather (their block ids, then their rows), and which positions are
    before `end`: the others read as zeros; both as DTYPE. The pool is (slots, 2, KV heads, D)
    by its strides; the block table's row b at tables_ptr + b * stride_tb."""
    d = tl.arange(0, D)
    tok = first + tl.arange(0, TOKENS)
    valid = tok < end
    block_ids = tl.load(tables_ptr + b * stride_tb + tok // BLOCK, mask=valid, other=0)
    slots = block_ids.to(tl.int64) * BLOCK + tok % BLOCK
    base = pool_ptr + slots[:, None] * stride_slot + kvh * stride_ph + d[None, :]
    k = tl.load(base, mask=valid[:, None], other=0.0).to(DTYPE)
    v = tl.load(base + stride_kv, mask=valid[:, None], other=0.0).to(DTYPE)
    return k, v, valid
