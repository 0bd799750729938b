"""The Triton kernels against plain-PyTorch references, on the CPU through Triton's interpreter.

Run as a script (`TRITON_INTERPRET=1` must be set before Triton is imported, so the test starts
it in a subprocess); prints one line per check and exits non-zero on the first mismatch.
"""

from __future__ import annotations

import math
import sys

import torch


def check_paged_decode() -> None:
    from engine.kernels.paged_decode import PagedDecode

    torch.manual_seed(0)
    b, heads, kv_heads, hd, bs, blocks = 4, 9, 3, 64, 16, 60
    pool = torch.randn(blocks * bs, 2, kv_heads, hd)
    ctx = torch.tensor([1, 16, 37, 300])
    order = torch.randperm(blocks)
    tables = torch.zeros(b, 32, dtype=torch.int64)
    used = 0
    for i in range(b):
        n = math.ceil(int(ctx[i]) / bs)
        tables[i, :n] = order[used : used + n]
        used += n
    q = torch.randn(b, heads, hd)
    # Context lengths as a strided column, as CUDA graphs keep them.
    rows = torch.zeros(b, 3, dtype=torch.int64)
    rows[:, 1] = ctx
    cpu = torch.device("cpu")
    split = PagedDecode(b, heads, kv_heads, hd, bs, 512, cpu, part_blocks=4)
    # Long partitions: one program walks up to 32 blocks of a context.
    whole = PagedDecode(b, heads, kv_heads, hd, bs, 512, cpu, part_blocks=32)
    out = split(q, pool, tables, rows[:, 1])
    looped = whole(q, pool, tables, rows[:, 1])
    for i in range(b):
        c = int(ctx[i])
        pos = torch.arange(c)
        slots = tables[i][pos // bs] * bs + pos % bs
        k = pool[slots, 0].repeat_interleave(heads // kv_heads, 1)  # (c, heads, hd)
        v = pool[slots, 1].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,chd->hc", q[i], k) / math.sqrt(hd)
        ref = torch.einsum("hc,chd->hd", scores.softmax(-1), v)
        err = max(float((out[i] - ref).abs().max()), float((looped[i] - ref).abs().max()))
        print(f"paged decode, context {c}: max error {err:.2e}")
        if err > 1e-4:
            sys.exit(1)


def check_w8a16() -> None:
    from engine.kernels.w8a16 import w8a16_matmul

    torch.manual_seed(0)
    cases = [(1, 48, 300, 1), (5, 64, 512, 1), (20, 100, 256, 1), (1, 48, 512, 4), (7, 80, 256, 2)]
    for m, n, k, split in cases:
        x = torch.randn(m, k).half()
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        s = torch.rand(n).half()
        ref = (x.float() @ w.float().t()) * s.float()
        for _ in range(2):  # a split launch must leave its tile counters at zero for the next
            out = w8a16_matmul(x, w, s, tiles=(32, 128, split))
            rel = float((out.float() - ref).abs().max()) / float(ref.abs().max())
            print(f"int8 matmul {m}x{n}x{k}, K split {split}: relative error {rel:.2e}")
            if rel > 2e-3:
                sys.exit(1)


def check_fused() -> None:
    import torch.nn.functional as F

    from engine.kernels import fused
    from engine.rope import apply_rope

    torch.manual_seed(0)
    x, res, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    out, summed = fused.add_rms_norm(x, res, w, 1e-5)
    want = F.rms_norm(x + res, (96,), w, 1e-5)
    err = max(float((out - want).abs().max()), float((summed - (x + res)).abs().max()))
    alone, kept = fused.add_rms_norm(x, None, w, 1e-5)
    err = max(err, float((alone - F.rms_norm(x, (96,), w, 1e-5)).abs().max()))
    print(f"add + rms norm: max error {err:.2e}")
    if err > 1e-5 or not torch.equal(kept, x):
        sys.exit(1)

    t, h, kv, hd = 4, 6, 2, 32
    qkv = torch.randn(t, h + 2 * kv, hd)
    angles = torch.rand(t, hd // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    pool = torch.zeros(20, 2, kv, hd)
    slots = torch.tensor([3, 9, 0, 17])
    expect_q = apply_rope(qkv[:, :h], cos, sin)
    expect_k = apply_rope(qkv[:, h : h + kv], cos, sin)
    expect_v = qkv[:, h + kv :].clone()
    fused.rope_and_store(qkv, cos, sin, pool, slots, h, kv)
    err = max(
        float((qkv[:, :h] - expect_q).abs().max()),
        float((pool[slots, 0] - expect_k).abs().max()),
        float((pool[slots, 1] - expect_v).abs().max()),
    )
    print(f"rope + kv store: max error {err:.2e}")
    if err > 1e-5:
        sys.exit(1)

    gate_up = torch.randn(3, 2 * 1500)
    err = float(
        (fused.silu_mul(gate_up) - F.silu(gate_up[:, :1500]) * gate_up[:, 1500:]).abs().max()
    )
    print(f"silu * up: max error {err:.2e}")
    if err > 1e-5:
        sys.exit(1)


if __name__ == "__main__":
    check_paged_decode()
    check_w8a16()
    check_fused()
