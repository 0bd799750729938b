"""The merge of flash-decoding's partitions, run by the last partition of a (sequence, KV head)
to finish (an atomic counter tells it): no second launch, whose programs would mostly return at
once, and no round trip through the host's launch queue. engine/kernels/rope_attention.py and
engine/kernels/paged_decode.py end with it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _merge(
    acc_ptr, m_ptr, l_ptr, out_ptr, b, kvh, parts,
    H: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    MAX_PARTS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Sequence b's partial results for the GROUP query heads of KV head kvh, weighed together
    and written to out_ptr (that sequence's row, heads contiguous), CHUNK partitions per round
    trip to L2. The partials are at ((b * H + head) * MAX_PARTS + s) of acc (× D), m and l."""
    g = tl.arange(0, GP)
    gmask = g < GROUP
    d = tl.arange(0, D)
    rows = (b * H + kvh * GROUP + g) * MAX_PARTS  # (GP,)
    m_all = tl.full([GP], float("-inf"), tl.float32)
    l_all = tl.zeros([GP], tl.float32)
    total = tl.zeros([GP, D], tl.float32)
    c = parts * 0  # a while loop: Triton's interpreter cannot range over a loaded bound
    while c < parts:
        t = c + tl.arange(0, CHUNK)
        at = rows[:, None] + t[None, :]  # (GP, CHUNK)
        mask = gmask[:, None] & (t < parts)[None, :]
        # Written by other programs: read past this one's L1.
        m_t = tl.load(m_ptr + at, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l_t = tl.load(l_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
        a_t = tl.load(acc_ptr + at[:, :, None] * D + d[None, None, :], mask=mask[:, :, None],
                      other=0.0, cache_modifier=".cg")  # (GP, CHUNK, D)  # fmt: skip
        m_new = tl.maximum(m_all, tl.max(m_t, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w_old = tl.exp(m_all - m_safe)
        w_t = tl.exp(m_t - m_safe[:, None])  # (GP, CHUNK)
        l_all = l_all * w_old + tl.sum(l_t * w_t, 1)
        total = total * w_old[:, None] + tl.sum(a_t * w_t[:, :, None], 1)
        m_all = m_new
        c += CHUNK
    out = total / tl.where(gmask, l_all, 1.0)[:, None]
    dest = out_ptr + (kvh * GROUP + g)[:, None] * D + d[None, :]
    tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def merge_when_last(
    counter_ptr, acc_ptr, m_ptr, l_ptr, out_ptr, b, kvh, parts,
    H: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    MAX_PARTS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Called by each of the `parts` partitions of (b, kvh) once its partial is stored: the last
    to arrive merges them all (`_merge`'s arguments) and resets the counter for the next launch.
    The counter's acquire-release orders every partial's stores before the merge's loads."""
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == parts - 1:
        # Every partition has arrived, and the next launch starts after this one ends: the reset
        # needs no ordering, and issued first its round trip overlaps the merge's loads.
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed")
        _merge(acc_ptr, m_ptr, l_ptr, out_ptr, b, kvh, parts, H, GROUP, GP, D, MAX_PARTS, CHUNK)
