"""The merge of flash-decoding's partitions inside the kernel that made them: no second launch,
whose programs would mostly return at once, and no round trip through the host's launch queue.
Two ways to know that every partial has arrived:

- `merge_when_last` (engine/kernels/paged_decode.py): each partition bumps an atomic counter
  after its stores; the last to arrive merges. Its release waits for the stores, then the
  atomic's and the merge's loads go to L2 in turn: three round trips.
- `merge_flagged` (engine/kernels/rope_attention.py, batch-1 decode): each partial word carries
  the launch's flag in its high half (`pack`), so the merger, a fixed partition, reads the
  partials until every flag is this launch's: no fence, no counter, one round trip when they
  are there. The merger waits on its siblings, so they must all be able to run: true where the
  grid's live programs fit on the GPU at once or run in order before it (the merger is the
  highest partition, dispatched after them).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fold(m_all, l_all, total, m_t, l_t, a_t):
    """The running (max, sum, weighted total) of GP heads with CHUNK more partials folded in:
    m_t, l_t (GP, CHUNK), a_t (GP, CHUNK, D)."""
    m_new = tl.maximum(m_all, tl.max(m_t, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    w_old = tl.exp(m_all - m_safe)
    w_t = tl.exp(m_t - m_safe[:, None])  # (GP, CHUNK)
    l_all = l_all * w_old + tl.sum(l_t * w_t, 1)
    total = total * w_old[:, None] + tl.sum(a_t * w_t[:, :, None], 1)
    return m_new, l_all, total


@triton.jit
def _store_heads(out_ptr, total, l_all, kvh, GROUP: tl.constexpr, GP: tl.constexpr,
                 D: tl.constexpr):  # fmt: skip
    """The merged heads of KV head kvh's group, total / l_all, into out_ptr's row."""
    g = tl.arange(0, GP)
    gmask = g < GROUP
    out = total / tl.where(gmask, l_all, 1.0)[:, None]
    dest = out_ptr + (kvh * GROUP + g)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


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
        m_all, l_all, total = _fold(m_all, l_all, total, m_t, l_t, a_t)
        c += CHUNK
    _store_heads(out_ptr, total, l_all, kvh, GROUP, GP, D)


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


@triton.jit
def pack(x, flag):
    """fp32 x's bits in the low half of an int64 word, `flag` (int64, already shifted) above:
    one 8-byte store, which no reader sees half written."""
    return flag | x.to(tl.uint32, bitcast=True).to(tl.int64)


@triton.jit
def _unpack(word):
    return (word & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def merge_flagged(
    acc_ptr, m_ptr, l_ptr, out_ptr, b, kvh, parts, epoch,
    H: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    MAX_PARTS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """`_merge` over partials stored with `pack(value, epoch << 32)`, each read again until it
    holds this launch's epoch (the words of earlier launches hold lower ones)."""
    g = tl.arange(0, GP)
    gmask = g < GROUP
    d = tl.arange(0, D)
    rows = (b * H + kvh * GROUP + g) * MAX_PARTS  # (GP,)
    flag = epoch.to(tl.int64) << 32
    m_all = tl.full([GP], float("-inf"), tl.float32)
    l_all = tl.zeros([GP], tl.float32)
    total = tl.zeros([GP, D], tl.float32)
    c = parts * 0  # a while loop: Triton's interpreter cannot range over a loaded bound
    while c < parts:
        t = c + tl.arange(0, CHUNK)
        at = rows[:, None] + t[None, :]  # (GP, CHUNK)
        mask = gmask[:, None] & (t < parts)[None, :]
        m_w = tl.zeros([GP, CHUNK], tl.int64)
        l_w = tl.zeros([GP, CHUNK], tl.int64)
        a_w = tl.zeros([GP, CHUNK, D], tl.int64)
        ready = 0
        while ready == 0:
            # Written by other programs of this launch: volatile, past this one's L1.
            m_w = tl.load(m_ptr + at, mask=mask, other=flag | 0xFF800000, volatile=True)  # -inf
            l_w = tl.load(l_ptr + at, mask=mask, other=flag, volatile=True)
            a_w = tl.load(acc_ptr + at[:, :, None] * D + d[None, None, :], mask=mask[:, :, None],
                          other=flag, volatile=True)  # (GP, CHUNK, D)  # fmt: skip
            ok = tl.min(((a_w >> 32) == epoch).to(tl.int32), 2)
            ok = ok & ((m_w >> 32) == epoch).to(tl.int32) & ((l_w >> 32) == epoch).to(tl.int32)
            ready = tl.min(tl.min(ok, 1), 0)
        m_t, l_t, a_t = _unpack(m_w), _unpack(l_w), _unpack(a_w)
        m_all, l_all, total = _fold(m_all, l_all, total, m_t, l_t, a_t)
        c += CHUNK
    _store_heads(out_ptr, total, l_all, kvh, GROUP, GP, D)
