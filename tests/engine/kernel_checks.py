"""The Triton kernels against plain-PyTorch references, on the CPU through Triton's interpreter.

Run as a script (`TRITON_INTERPRET=1` must be set before Triton is imported, so the test starts
it in a subprocess); prints one line per check and exits non-zero on the first mismatch.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch


def scattered_tables(ctx: torch.Tensor, bs: int, blocks: int, width: int) -> torch.Tensor:
    """Block tables (len(ctx), width) holding each context in distinct blocks of a pool of
    `blocks`, taken in random order."""
    order = torch.randperm(blocks, device=ctx.device)
    tables = torch.zeros(len(ctx), width, dtype=torch.int64, device=ctx.device)
    used = 0
    for i, c in enumerate(ctx.tolist()):
        n = math.ceil(c / bs)
        tables[i, :n] = order[used : used + n]
        used += n
    return tables


def check_paged_decode() -> None:
    from engine.kernels.paged_decode import PagedDecode, Tiling

    torch.manual_seed(0)
    b, heads, kv_heads, hd, bs, blocks = 4, 9, 3, 64, 16, 60
    pool = torch.randn(blocks * bs, 2, kv_heads, hd)
    ctx = torch.tensor([1, 16, 37, 300])
    tables = scattered_tables(ctx, bs, blocks, 32)
    q = torch.randn(b, heads, hd)
    # Context lengths as a strided column, as CUDA graphs keep them.
    rows = torch.zeros(b, 3, dtype=torch.int64)
    rows[:, 1] = ctx
    cpu = torch.device("cpu")
    split = PagedDecode(b, heads, kv_heads, hd, bs, 512, cpu, part_blocks=4)
    # Long partitions: one program walks up to 32 blocks of a context.
    whole = PagedDecode(b, heads, kv_heads, hd, bs, 512, cpu, part_blocks=32)
    # Four blocks a loop iteration, the loop stopping at the context's end.
    tiled = PagedDecode(
        b, heads, kv_heads, hd, bs, 512, cpu, part_blocks=8, tiling=Tiling(64, 4, True)
    )
    out = split(q, pool, tables, rows[:, 1])
    looped = whole(q, pool, tables, rows[:, 1])
    walked = tiled(q, pool, tables[:, :31], rows[:, 1])  # a table width no multiple of 16
    # The last partition to finish merges and resets its counter for the next launch.
    for kernel in (split, whole, tiled):
        assert not kernel.counters.any()
    assert torch.equal(split(q, pool, tables, rows[:, 1]), out)
    for i in range(b):
        c = int(ctx[i])
        pos = torch.arange(c)
        slots = tables[i][pos // bs] * bs + pos % bs
        k = pool[slots, 0].repeat_interleave(heads // kv_heads, 1)  # (c, heads, hd)
        v = pool[slots, 1].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,chd->hc", q[i], k) / math.sqrt(hd)
        ref = torch.einsum("hc,chd->hd", scores.softmax(-1), v)
        err = max(float((x[i] - ref).abs().max()) for x in (out, looped, walked))
        print(f"paged decode, context {c}: max error {err:.2e}")
        if err > 1e-4:
            sys.exit(1)
    # An fp8 pool, widened in registers: attention over its values as floats.
    pool8 = pool.to(torch.float8_e4m3fn)
    out = split(q, pool8, tables, ctx)
    # The fp8 pool's own tiling: 128 tokens an iteration, over partitions of 32 blocks.
    fp8_tiled = PagedDecode(b, heads, kv_heads, hd, bs, 512, cpu, 32, kv_dtype=torch.float8_e4m3fn)
    assert fp8_tiled.tiling(b).tile == 128
    # A bf16 pool: two warps and two stages once (sequence, KV head) pairs number 128 or more.
    rule = PagedDecode(64, 32, 8, 128, bs, 512, cpu)
    assert rule.tiling(16) == Tiling(64, 2, True, 2) and rule.tiling(8) == Tiling(64, 4, True, 3)
    wide = fp8_tiled(q, pool8, tables, ctx)
    for i in range(b):
        c = int(ctx[i])
        pos = torch.arange(c)
        slots = tables[i][pos // bs] * bs + pos % bs
        k = pool8[slots, 0].float().repeat_interleave(heads // kv_heads, 1)
        v = pool8[slots, 1].float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,chd->hc", q[i], k) / math.sqrt(hd)
        ref = torch.einsum("hc,chd->hd", scores.softmax(-1), v)
        err = max(float((x[i] - ref).abs().max()) for x in (out, wide))
        print(f"paged decode over fp8, context {c}: max error {err:.2e}")
        if err > 5e-3:  # the queries rounded to fp16, in which an fp8 pool is multiplied
            sys.exit(1)


def check_paged_decode_new_token() -> None:
    """attend_new (Q and K rotated, K/V stored, then attention) against RoPE + store, then
    attention over the stored pool: the two launches a decode step made before, to the bit."""
    from engine.kernels import fused
    from engine.kernels.paged_decode import PagedDecode, Tiling

    torch.manual_seed(1)
    b, heads, kv_heads, hd, bs, blocks = 5, 9, 3, 64, 16, 60
    cpu = torch.device("cpu")
    # 1: the new token alone; 16: the last of a block; 65: the first of a second partition of
    # 4 blocks (no pooled token in it); 37, 130: inside one.
    ctx = torch.tensor([1, 16, 65, 37, 130])
    tables = scattered_tables(ctx, bs, blocks, 16)
    new_pos = ctx - 1
    slots = tables[torch.arange(b), new_pos // bs] * bs + new_pos % bs
    angles = torch.rand(b, hd // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    kernels = {
        "partitions of 4 blocks": PagedDecode(b, heads, kv_heads, hd, bs, 512, cpu, part_blocks=4),
        "one partition, 4 blocks a tile": PagedDecode(
            b, heads, kv_heads, hd, bs, 512, cpu, part_blocks=32, tiling=Tiling(64, 4, True)
        ),
        "static tiles": PagedDecode(
            b, heads, kv_heads, hd, bs, 512, cpu, part_blocks=4, tiling=Tiling(32, 4, False)
        ),
    }
    for dtype in (torch.float32, torch.float8_e4m3fn):
        for name, kernel in kernels.items():
            pool = torch.randn(blocks * bs, 2, kv_heads, hd).to(dtype)
            qkv = torch.randn(b, heads + 2 * kv_heads, hd)
            qkv[0, heads + kv_heads, 0] = 1000.0  # saturates in an fp8 pool
            want_pool, rotated = pool.clone(), qkv.clone()
            fused.rope_and_store(rotated, cos, sin, want_pool, slots, heads, kv_heads)
            want = kernel(rotated[:, :heads], want_pool, tables, ctx)
            got = kernel.attend_new(qkv, cos, sin, slots, pool, tables, ctx)
            err = float((got - want).abs().max())
            stored = torch.equal(pool.float(), want_pool.float())
            print(f"paged decode, new token rotated and stored ({name}, {dtype}): "
                  f"max error {err:.2e}, pool {'equal' if stored else 'DIFFERS'}")  # fmt: skip
            if err > 0 or not stored:  # the same loop over the same pool: the same sums
                sys.exit(1)
            assert not kernel.counters.any()


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
    # FP8 weights: the same kernel reads their bytes and widens them as e4m3.
    for m, n, k, split in cases[:2] + cases[3:4]:
        x = torch.randn(m, k).half()
        w = (torch.randn(n, k) * 50).to(torch.float8_e4m3fn)
        s = torch.rand(n).half()
        ref = (x.float() @ w.float().t()) * s.float()
        out = w8a16_matmul(x, w, s, tiles=(32, 128, split))
        rel = float((out.float() - ref).abs().max()) / float(ref.abs().max())
        print(f"fp8 matmul {m}x{n}x{k}, K split {split}: relative error {rel:.2e}")
        if rel > 2e-3:
            sys.exit(1)


def check_fp8_rows() -> None:
    from engine.kernels.fp8_rows import rows_to_fp8
    from engine.quant import FP8_MAX

    torch.manual_seed(0)
    x = torch.randn(7, 3000).bfloat16()  # wider than one block: two passes of two blocks
    x[2, 2500] = 300.0  # an outlier sets its row's scale alone
    x[4] = 0  # an all-zero row
    codes, scales = rows_to_fp8(x)
    want_scales = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    rel = float(((codes.float() * scales) - x.float()).norm() / x.float().norm())
    print(f"fp8 rows: relative error {rel:.2e}")
    # The interpreter's e4m3 conversion does not carry a rounding into the next power of two
    # (127.4 becomes 64): codes are compared as values here, byte for byte on the GPU
    # (tests/gpu/test_cuda.py).
    if not torch.allclose(scales, want_scales) or rel > 0.05:
        sys.exit(1)
    if codes.float().abs().amax(dim=1)[2] != FP8_MAX or codes[4].float().abs().max() != 0:
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
    # Into an fp8 pool: each value rounded to e4m3 as torch rounds it, 448 where it is beyond.
    qkv = torch.randn(t, h + 2 * kv, hd)
    qkv[0, h + kv, 0] = 1000.0
    pool8 = torch.zeros(20, 2, kv, hd, dtype=torch.float8_e4m3fn)
    expect_k = apply_rope(qkv[:, h : h + kv], cos, sin)
    expect_v = qkv[:, h + kv :].clone()
    fused.rope_and_store(qkv, cos, sin, pool8, slots, h, kv)
    want = torch.stack([expect_k, expect_v], 1).clamp(-448, 448).to(torch.float8_e4m3fn)
    # RoPE's fp32 arithmetic may round a K differently by one e4m3 step: compare as floats.
    err = float((pool8[slots].float() - want.float()).abs().max() / want.float().abs().max())
    print(f"rope + kv store into fp8: relative error {err:.2e}")
    if err > 1e-2 or float(pool8[slots[0], 1, 0, 0].float()) != 448.0:
        sys.exit(1)

    gate_up = torch.randn(3, 2 * 1500)
    err = float(
        (fused.silu_mul(gate_up) - F.silu(gate_up[:, :1500]) * gate_up[:, 1500:]).abs().max()
    )
    print(f"silu * up: max error {err:.2e}")
    if err > 1e-5:
        sys.exit(1)


def check_row_gemv() -> None:
    import torch.nn.functional as F

    from engine.kernels.row_gemv import NORM, RESIDUAL, SWIGLU, row_gemv

    torch.manual_seed(0)
    # Tiles that divide the product evenly (unmasked loads), and tiles that do not.
    # The last: more partial sums of squares (80) than a tile is wide (32).
    shapes = [(40, 96, (8, 64, 4)), (32, 128, (8, 64, 4)), (33, 600, (8, 64, 4)),
              (160, 64, (2, 32, 4))]  # fmt: skip
    for n, k, tile in shapes:
        x, res, g, w = torch.randn(1, k), torch.randn(1, n), torch.randn(k), torch.randn(n, k)
        gate_up_w, w_next, g_next = torch.randn(2 * n, k), torch.randn(24, n), torch.randn(n)
        y = x @ w.t()
        gate_up = x @ gate_up_w.t()
        stream, squares = row_gemv(x, w, epilogue=RESIDUAL, residual=res, tile=tile)
        assert squares is not None
        cases = {
            "plain": (row_gemv(x, w, tile=tile)[0], y),
            "residual": (stream, res + y),
            "sum of squares": (squares.sum(), (res + y).square().sum()),
            "norm": (
                row_gemv(x, w, prologue=NORM, norm_weight=g, eps=1e-5, tile=tile)[0],
                F.rms_norm(x, (k,), g, 1e-5) @ w.t(),
            ),
            "norm from partial squares": (
                row_gemv(stream, w_next, prologue=NORM, squares=squares, norm_weight=g_next,
                         eps=1e-5, tile=tile)[0],
                F.rms_norm(res + y, (n,), g_next, 1e-5) @ w_next.t(),
            ),
            "silu * up": (
                row_gemv(x, gate_up_w, epilogue=SWIGLU, tile=tile)[0],
                F.silu(gate_up[:, :n]) * gate_up[:, n:],
            ),
        }  # fmt: skip
        # Int8 weights, every byte value included, a scale per row. Their products lose some
        # precision by design (row_gemv.py): ~4e-5 of the largest output.
        q = torch.randint(-128, 128, (2 * n, k), dtype=torch.int8)
        q.view(-1)[:256] = torch.arange(-128, 128, dtype=torch.int8)
        scale = torch.rand(2 * n) + 0.5
        wq = q.float() * scale[:, None]
        normed = F.rms_norm(x, (k,), g, 1e-5)
        cases["int8 norm"] = (
            row_gemv(x, q, scale, prologue=NORM, norm_weight=g, eps=1e-5, tile=tile)[0],
            normed @ wq.t(),
        )
        int8_gate_up = normed @ wq.t()
        cases["int8 norm, silu * up"] = (
            row_gemv(x, q, scale, prologue=NORM, norm_weight=g, eps=1e-5, epilogue=SWIGLU,
                     tile=tile)[0],
            F.silu(int8_gate_up[:, :n]) * int8_gate_up[:, n:],
        )  # fmt: skip
        cases["int8 residual"] = (
            row_gemv(x, q[:n].contiguous(), scale[:n].contiguous(), epilogue=RESIDUAL,
                     residual=res, tile=tile)[0],
            res + x @ wq[:n].t(),
        )  # fmt: skip
        # The same int8 weights with 16-bit inputs, as the engine has them: read four to a
        # 64-bit word (fp32 inputs are read one by one). The normed input is rounded to fp16 and
        # times g in fp16, as in the model; a residual sum is rounded to fp16.
        xh, gh, resh = x.half(), g.half(), res.half()
        q_n, scale_n = q[:n].contiguous(), scale[:n].contiguous()
        cases["int8 fp16 plain"] = (
            row_gemv(xh, q_n, scale_n, out_dtype=torch.float32, tile=tile)[0],
            xh.float() @ wq[:n].t(),
        )
        normed_h = (F.rms_norm(xh.float(), (k,), None, 1e-5).half() * gh).float()
        cases["int8 fp16 norm"] = (
            row_gemv(xh, q_n, scale_n, prologue=NORM, norm_weight=gh, eps=1e-5,
                     out_dtype=torch.float32, tile=tile)[0],
            normed_h @ wq[:n].t(),
        )  # fmt: skip
        cases["int8 fp16 residual"] = (
            row_gemv(xh, q_n, scale_n, epilogue=RESIDUAL, residual=resh, tile=tile)[0].float(),
            resh.float() + xh.float() @ wq[:n].t(),
        )
        # FP8 weights, every finite e4m3 byte included, widened exactly: fp32's own rounding.
        bits = torch.randint(0, 256, (2 * n, k), dtype=torch.uint8)
        bits[(bits & 0x7F) == 0x7F] = 0  # e4m3's NaNs
        bits.view(-1)[:254] = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F])
        f8 = bits.view(torch.float8_e4m3fn)
        wf = f8.float() * scale[:, None]
        fp8_gate_up = normed @ wf.t()
        cases["fp8 norm, silu * up"] = (
            row_gemv(x, f8, scale, prologue=NORM, norm_weight=g, eps=1e-5, epilogue=SWIGLU,
                     tile=tile)[0],
            F.silu(fp8_gate_up[:, :n]) * fp8_gate_up[:, n:],
        )  # fmt: skip
        cases["fp8 residual"] = (
            row_gemv(x, f8[:n].contiguous(), scale[:n].contiguous(), epilogue=RESIDUAL,
                     residual=res, tile=tile)[0],
            res + x @ wf[:n].t(),
        )  # fmt: skip
        for name, (got, want) in cases.items():
            rel = float((got - want).abs().max()) / float(want.abs().max())
            print(f"row gemv {name} {n}x{k}: relative error {rel:.2e}")
            # fp16's rounding of the normed input and of the output: 2**-11 of a value.
            if rel > (1e-3 if "fp16 " in name and "plain" not in name else
                      3e-4 if name.startswith("int8") else 1e-5):  # fmt: skip
                sys.exit(1)


def check_prefill_attention() -> None:
    import torch.nn.functional as F

    from engine.kernels.prefill_attention import prefill_attention

    torch.manual_seed(0)
    # (queries, keys, heads, KV heads, head size, tiles): one token; a prompt shorter than a
    # tile; several tiles, the last partial; no GQA; tiles of fewer keys than queries; chunks
    # that continue a prompt, their first position inside a key tile or on its edge.
    cases = [(1, 1, 4, 2, 16, None), (37, 37, 4, 2, 16, None),
             (130, 130, 6, 2, 32, (64, 32, 4, 1, 1)), (200, 200, 3, 3, 16, (32, 32, 4, 1, 1)),
             (150, 150, 8, 2, 16, (64, 16, 4, 1, 1)), (40, 141, 4, 2, 16, (32, 16, 4, 1, 1)),
             (70, 134, 4, 1, 16, (64, 64, 4, 1, 1)), (1, 90, 4, 2, 16, None),
             (150, 150, 8, 2, 16, (64, 32, 4, 1, 4)), (40, 141, 8, 2, 16, (32, 16, 4, 1, 2)),
             (70, 134, 6, 2, 16, (64, 64, 4, 1, 4))]  # fmt: skip
    for length, ctx, heads, kv, hd, tiles in cases:
        q = torch.randn(length, heads, hd)
        k, v = torch.randn(ctx, kv, hd), torch.randn(ctx, kv, hd)
        got = prefill_attention(q, k, v, tiles=tiles)
        q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
        positions = torch.arange(ctx)
        causal = positions[None, :] <= positions[ctx - length :, None]
        want = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=causal, enable_gqa=True)
        err = float((got - want[0].transpose(0, 1)).abs().max())
        print(
            f"prefill attention {length} of {ctx} tokens, {heads}/{kv} heads: max error {err:.2e}"
        )
        if err > 1e-5:
            sys.exit(1)


def check_swiglu_gemm() -> None:
    import torch.nn.functional as F

    from engine.kernels.swiglu_gemm import swiglu_gemm

    torch.manual_seed(0)
    # (rows, F, K, tile): whole tiles; rows no multiple of the tile (TMA clips the last one),
    # weight tiles of several row tiles in turn (GROUP_M), more tiles than programs.
    tile = (32, 32, 32, 2, 4, 2, False)
    cases = [(64, 64, 128, tile), (100, 64, 64, tile), (96, 128, 64, (16, 32, 32, 4, 4, 2, False))]
    for rows, f, k, tile in cases:
        # fp16: the interpreter's bf16 is not reliable
        x = torch.randn(rows, k, dtype=torch.float16)
        w = (torch.randn(2 * f, k) / 8).half()
        gate_up = x.float() @ w.float().T
        want = F.silu(gate_up[:, :f]) * gate_up[:, f:]
        err = float((swiglu_gemm(x, w, tile).float() - want).abs().max() / want.abs().max())
        print(f"gate/up with SiLU·up, {rows} rows, F {f}, K {k}: max relative error {err:.2e}")
        if err > 2e-3:
            sys.exit(1)


def check_greedy() -> None:
    from engine.kernels.greedy import GreedyPicks

    torch.manual_seed(0)
    for vocab in (256, 1000):  # whole chunks, and a last chunk partly past the vocabulary
        picks = GreedyPicks(4, vocab, torch.device("cpu"), block=128)
        logits = torch.randn(3, vocab) * 4
        logits[1, [7, 250]] = 30.0  # a tie, in two chunks: the lower id wins
        for _ in range(2):  # the last chunk must leave the counters at zero for the next
            tokens, packed = picks(logits)
        want = logits.argmax(-1)
        logprobs = torch.log_softmax(logits.double(), -1).gather(1, want[:, None])[:, 0]
        err = float((packed[:, 1] - logprobs).abs().max())
        print(f"greedy picks, vocabulary {vocab}: max error {err:.2e}")
        ok = torch.equal(tokens, want) and torch.equal(packed[:, 0].long(), want)
        if err > 1e-5 or not ok or picks.counters.any():
            sys.exit(1)


def check_rope_attention() -> None:
    from engine.kernels import fused
    from engine.kernels.paged_decode import PagedDecode
    from engine.kernels.rope_attention import RopeAttention
    from engine.rope import inverse_frequencies

    torch.manual_seed(0)
    heads, kv_heads, hd, bs, blocks = 6, 2, 32, 4, 40
    inv_freq = inverse_frequencies(hd, 10000.0)
    cpu = torch.device("cpu")
    # Contexts that open a partition (8 tokens) with the new token, end one, or sit inside.
    for ctx in [1, 2, 8, 9, 17, 64, 70, 150]:  # 150: more partitions than one merge round
        pool = torch.randn(blocks * bs, 2, kv_heads, hd)
        want_pool = pool.clone()
        table = torch.randperm(blocks)[None, :]
        qkv = torch.randn(1, heads + 2 * kv_heads, hd)
        pos = ctx - 1
        slot = torch.tensor([int(table[0, pos // bs]) * bs + pos % bs])
        kernel = RopeAttention(1, heads, kv_heads, hd, bs, 160, cpu, part_blocks=2)
        for _ in range(2):  # the last partition must leave the counters at zero for the next
            out = kernel(qkv, inv_freq, pool, table, torch.tensor([ctx]), slot)
        # The three-launch path: rope tables, RoPE + store, paged attention.
        angles = torch.tensor([float(pos)])[:, None] * inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        rotated = qkv.clone()
        fused.rope_and_store(rotated, emb.cos(), emb.sin(), want_pool, slot, heads, kv_heads)
        q = rotated[:, :heads].contiguous()
        want = PagedDecode(1, heads, kv_heads, hd, bs, 160, cpu)(q, want_pool, table,
                                                                 torch.tensor([ctx]))  # fmt: skip
        err = max(float((out - want).abs().max()), float((pool - want_pool).abs().max()))
        print(f"rope + attention, context {ctx}: max error {err:.2e}")
        if err > 1e-5 or kernel.counters.any():
            sys.exit(1)


def tiny_llama() -> tuple[Any, Any]:
    """A two-layer LLaMA of random weights (GQA, 4 heads on 2) and its config."""
    from engine.config import ModelConfig
    from engine.model import Transformer
    from engine.rope import inverse_frequencies

    config = ModelConfig(
        vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
        rope_theta=10000.0, rms_norm_eps=1e-5, max_seq_len=128, tie_embeddings=False,
    )  # fmt: skip
    model = Transformer(config).eval()
    with torch.no_grad():
        model.inv_freq.copy_(inverse_frequencies(config.head_dim, config.rope_theta))
    return config, model


def check_model_fused_decodes() -> None:
    """The model's decode-only step with attention rotating and storing the new tokens
    (AttentionMetadata.fused_decodes, as CUDA graphs run it) against RoPE + store first."""
    from engine.attention import build_metadata
    from engine.kernels.paged_decode import PagedDecode
    from engine.kv_cache import KVCache

    torch.manual_seed(0)
    config, model = tiny_llama()
    cpu, bs = torch.device("cpu"), 4
    tables = [[5, 2, 9, 11, 3], [7, 1, 12, 14, 0]]
    lengths = [7, 4]
    kernel = PagedDecode(2, 4, 2, config.head_dim, bs, 128, cpu, part_blocks=1)
    kv, want_kv = (KVCache(config, 16, bs, torch.float32, cpu) for _ in range(2))
    prompts = [torch.randint(0, 300, (n,)) for n in lengths]
    with torch.inference_mode():
        for cache in (kv, want_kv):  # the same prompts into both caches
            for prompt, table in zip(prompts, tables, strict=True):
                n = len(prompt)
                model(prompt, torch.arange(n), build_metadata([0], [n], [table], bs, cpu), cache)
        for step in range(3):  # the second sequence's first new position opens a block
            positions = [n + step for n in lengths]
            tokens = torch.tensor([p * 7 % 300 for p in positions])
            meta = build_metadata(positions, [1, 1], tables, bs, cpu, kernel)
            want = model(tokens, torch.tensor(positions), meta, want_kv)
            assert meta.fused_decodes is None and meta.decodes is not None
            meta.decodes.new_tokens = kernel  # type: ignore[attr-defined]
            assert meta.fused_decodes is not None
            got = model(tokens, torch.tensor(positions), meta, kv)
            err = max(float((got - want).abs().max()), float((kv.pool - want_kv.pool).abs().max()))
            print(f"model, decodes rotated and stored by attention, step {step}: "
                  f"max error {err:.2e}")  # fmt: skip
            if err > 1e-5:
                sys.exit(1)


def check_row_decoder() -> None:
    import copy

    from torch import nn

    from engine.attention import build_metadata
    from engine.kv_cache import KVCache
    from engine.quant import Int8Linear, quantize_int8
    from engine.row_decode import RowDecoder

    torch.manual_seed(0)
    config, model = tiny_llama()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    # Int8 weights against the model whose weights are exactly their values, q * scale.
    int8 = copy.deepcopy(model)
    quantize_int8(int8)
    dequantized = copy.deepcopy(int8)
    for module in list(dequantized.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Int8Linear):
                linear = nn.Linear(child.in_features, child.out_features, bias=False)
                linear.weight.data = child.weight.float() * child.scale[:, None]
                setattr(module, name, linear)
    cpu, bs = torch.device("cpu"), 4
    table = [5, 2, 9, 11, 3]
    prompt = torch.randint(0, 300, (7,))
    for label, served, reference in [("", model, model), ("int8 ", int8, dequantized)]:
        kv, want_kv = (KVCache(config, 16, bs, torch.float32, cpu) for _ in range(2))
        with torch.inference_mode():
            for cache in (kv, want_kv):  # the same prefill into both caches
                meta = build_metadata([0], [7], [table], bs, cpu)
                reference(prompt, torch.arange(7), meta, cache)
            decoder = RowDecoder(served, kv)
            for pos in range(7, 13):  # decode steps crossing a block boundary
                token = torch.tensor([pos * 7 % 300])
                meta = build_metadata([pos], [1], [table], bs, cpu)
                want = reference.logits(reference(token, torch.tensor([pos]), meta, want_kv))
                slot = torch.tensor([table[pos // bs] * bs + pos % bs])
                got = decoder(token, slot, torch.tensor([pos + 1]), torch.tensor([table]))
                err = max(
                    float((got - want).abs().max()) / float(want.abs().max()),
                    float((kv.pool - want_kv.pool).abs().max()),
                )
                print(f"{label}row decoder, position {pos}: relative error {err:.2e}")
                if err > (3e-4 if label else 1e-5):
                    sys.exit(1)


if __name__ == "__main__":
    check_paged_decode()
    check_paged_decode_new_token()
    check_w8a16()
    check_fp8_rows()
    check_fused()
    check_row_gemv()
    check_prefill_attention()
    check_swiglu_gemm()
    check_rope_attention()
    check_greedy()
    check_row_decoder()
    check_model_fused_decodes()
