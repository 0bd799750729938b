"""The CUDA path: kernels against references, graphs against eager, bf16 against fp32 and
transformers. Marked `gpu`: skipped where there is no CUDA device."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine
from tests.engine.kernel_checks import scattered_tables

if TYPE_CHECKING:  # imports Triton
    from engine.cuda_graphs import GraphOutputs

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(
    "tiling",
    [
        None,
        (4, 16, 4, False),
        (16, 64, 8, True),
        (32, 64, 4, False),
        (8, 32, 4, True),
        (64, 64, 2, True, 2),  # many sequences' default
    ],
)
def test_paged_decode_kernel_matches_attention(tiling: tuple[int | bool, ...] | None) -> None:
    from engine.kernels.paged_decode import PagedDecode, Tiling

    torch.manual_seed(0)
    b, heads, kv_heads, hd, bs, blocks = 5, 32, 8, 128, 16, 400
    pool = torch.randn(blocks * bs, 2, kv_heads, hd, device=CUDA, dtype=torch.bfloat16)
    ctx = torch.tensor([1, 17, 300, 1000, 2047], device=CUDA)
    tables = scattered_tables(ctx, bs, blocks, 128)
    q = torch.randn(b, heads, hd, device=CUDA, dtype=torch.bfloat16)
    if tiling is None:  # the defaults
        kernel = PagedDecode(8, heads, kv_heads, hd, bs, 2048, CUDA)
    else:
        part, *walk = tiling
        kernel = PagedDecode(8, heads, kv_heads, hd, bs, 2048, CUDA, int(part), Tiling(*walk))
    out = kernel(q, pool, tables[:, :127], ctx)  # a table width no multiple of 16
    for i in range(b):
        c = int(ctx[i])
        pos = torch.arange(c, device=CUDA)
        slots = tables[i][pos // bs] * bs + pos % bs
        k = pool[slots, 0].float().repeat_interleave(heads // kv_heads, 1)  # (c, heads, hd)
        v = pool[slots, 1].float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,chd->hc", q[i].float(), k) / math.sqrt(hd)
        ref = torch.einsum("hc,chd->hd", scores.softmax(-1), v)
        assert rel(out[i], ref) < 2e-2


@pytest.mark.parametrize("batch", [5, 256])  # four warps and three stages; two and two
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_paged_decode_rotates_and_stores_the_new_token(batch: int, kv_dtype: torch.dtype) -> None:
    """attend_new, as decode graphs run it, against RoPE + K/V store, then attention: the same
    pool bytes and the same output, bit for bit (graphs are checked against eager steps, which
    take the two launches)."""
    from engine.kernels import fused
    from engine.kernels.paged_decode import PagedDecode

    torch.manual_seed(0)
    heads, kv_heads, hd, bs = 32, 8, 128, 16
    ctx = torch.tensor([1, 17, 1025, 1000, 2047] * (batch // 5) + [640] * (batch % 5), device=CUDA)
    blocks = int(sum(math.ceil(int(c) / bs) for c in ctx))
    pool = torch.randn(blocks * bs, 2, kv_heads, hd, device=CUDA).to(kv_dtype)
    tables = scattered_tables(ctx, bs, blocks, 128)
    new = ctx - 1
    slots = tables[torch.arange(batch, device=CUDA), new // bs] * bs + new % bs
    angles = new[:, None].float() * 0.5 ** torch.arange(hd // 2, device=CUDA)[None, :]
    cos = torch.cat([angles.cos()] * 2, -1).to(torch.bfloat16)
    sin = torch.cat([angles.sin()] * 2, -1).to(torch.bfloat16)
    qkv = torch.randn(batch, heads + 2 * kv_heads, hd, device=CUDA, dtype=torch.bfloat16)
    kernel = PagedDecode(batch, heads, kv_heads, hd, bs, 2048, CUDA, kv_dtype=kv_dtype)
    want_pool, rotated = pool.clone(), qkv.clone()
    fused.rope_and_store(rotated, cos, sin, want_pool, slots, heads, kv_heads)
    want = kernel(rotated[:, :heads], want_pool, tables, ctx)
    got = kernel.attend_new(qkv, cos, sin, slots, pool, tables, ctx)
    # The same bytes: a key one rounding step off would move a real model's logits by percents
    # over a few steps (graphs would no longer equal eager steps).
    assert torch.equal(pool.view(torch.uint8), want_pool.view(torch.uint8))
    assert torch.equal(got, want)
    assert not kernel.counters.any()


@pytest.mark.parametrize("shape", [(1100, 256, 512), (2048, 14336, 4096)])
def test_gate_up_with_silu_in_one_kernel_matches_fp32(shape: tuple[int, int, int]) -> None:
    """engine/kernels/swiglu_gemm.py: ragged rows (TMA clips the last tile) and the 8B shapes."""
    import torch.nn.functional as F

    from engine.kernels.swiglu_gemm import fits, swiglu_gemm

    rows, f, k = shape
    torch.manual_seed(0)
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(2 * f, k, device=CUDA, dtype=torch.bfloat16) / math.sqrt(k)
    assert fits(x, w)
    gate_up = x.float() @ w.float().T
    want = F.silu(gate_up[:, :f]) * gate_up[:, f:]
    assert rel(swiglu_gemm(x, w), want) < 1e-2


def test_prompts_of_1024_rows_take_the_fused_gate_up() -> None:
    """ops.gate_up_silu: the fused kernel from 1,024 rows, agreeing with product + silu_mul;
    fewer rows through exactly the product and silu_mul."""
    from engine import ops

    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 2 * 256, bias=False, device=CUDA, dtype=torch.bfloat16)
    x = torch.randn(1024, 512, device=CUDA, dtype=torch.bfloat16)
    fused, unfused = ops.gate_up_silu(x, lin), ops.silu_mul(lin(x))
    assert not torch.equal(fused, unfused)  # the fused kernel ran: it rounds gate/up no more
    assert rel(fused, unfused) < 2e-2
    assert torch.equal(ops.gate_up_silu(x[:1023], lin), ops.silu_mul(lin(x[:1023])))


@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)])
def test_prefill_attention_kernel_matches_sdpa(heads: tuple[int, int, int]) -> None:
    import torch.nn.functional as F

    from engine.kernels.prefill_attention import prefill_attention

    n_heads, n_kv, hd = heads
    torch.manual_seed(0)
    # From 2,048 queries the 8B heads take LONG_TILES (4 heads a program): a whole prompt, and a
    # chunk continuing 300 tokens.
    for length, ctx in ((1, 1), (100, 100), (2048, 2048), (2048, 2348)):
        q = torch.randn(length, n_heads, hd, device=CUDA, dtype=torch.bfloat16)
        k, v = (torch.randn(ctx, n_kv, hd, device=CUDA, dtype=torch.bfloat16) for _ in "kv")
        q4, k4, v4 = (t.float().transpose(0, 1)[None] for t in (q, k, v))
        pos = torch.arange(ctx, device=CUDA)
        causal = pos[None, :] <= pos[ctx - length :, None]
        want = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=causal, enable_gqa=True)
        out = torch.full_like(q, float("nan"))
        assert prefill_attention(q, k, v, out=out) is out
        assert rel(out, want[0].transpose(0, 1)) < 1e-2


@pytest.mark.parametrize("pdl", [False, True])  # with PDL, K/V are requested before the wait
def test_one_launch_rope_attention_matches_the_three_launch_path(pdl: bool) -> None:
    from engine.kernels import fused
    from engine.kernels.paged_decode import PagedDecode
    from engine.kernels.rope_attention import RopeAttention
    from engine.rope import inverse_frequencies

    torch.manual_seed(0)
    heads, kv_heads, hd, bs, blocks = 32, 8, 128, 16, 520
    inv_freq = inverse_frequencies(hd, 500000.0).to(CUDA)
    kernel = RopeAttention(1, heads, kv_heads, hd, bs, 8192, CUDA)
    reference = PagedDecode(1, heads, kv_heads, hd, bs, 8192, CUDA)
    for ctx in [1, 17, 64, 65, 1000, 8192]:  # far positions: the angles' range reduction
        pool = torch.randn(blocks * bs, 2, kv_heads, hd, device=CUDA, dtype=torch.bfloat16)
        want_pool = pool.clone()
        table = torch.randperm(blocks, device=CUDA)[None, :]
        qkv = torch.randn(1, heads + 2 * kv_heads, hd, device=CUDA, dtype=torch.bfloat16)
        pos = ctx - 1
        slot = table[0, pos // bs : pos // bs + 1] * bs + pos % bs
        lens = torch.tensor([ctx], device=CUDA)
        out = kernel(qkv, inv_freq, pool, table, lens, slot, pdl=pdl)
        angles = torch.tensor([float(pos)], device=CUDA)[:, None] * inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
        rotated = qkv.clone()
        fused.rope_and_store(rotated, cos, sin, want_pool, slot, heads, kv_heads)
        want = reference(rotated[:, :heads].contiguous(), want_pool, table, lens)
        assert rel(out, want) < 2e-2, ctx
        assert rel(pool, want_pool) < 1e-2, ctx  # the new K (rounded) and V at the right slot
        assert not kernel.counters.any()


def test_int8_kernel_matches_reference() -> None:
    from engine.kernels.w8a16 import w8a16_matmul

    torch.manual_seed(0)
    for m, n, k in [(1, 4096, 4096), (7, 6144, 4096), (64, 1024, 14336)]:
        x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
        w = torch.randint(-127, 128, (n, k), device=CUDA, dtype=torch.int8)
        s = torch.rand(n, device=CUDA, dtype=torch.bfloat16) / 100
        ref = (x.float() @ w.float().t()) * s.float()
        assert rel(w8a16_matmul(x, w, s), ref) < 1e-2


@pytest.fixture(scope="module")
def default_model(tandem_home: Path) -> Path:
    return registry.resolve(registry.DEFAULT_MODEL, tandem_home)


def prompt(n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def test_cuda_bf16_agrees_with_cpu_fp32_on_the_default_model(default_model: Path) -> None:
    cpu = Engine.from_path(
        default_model, "cpu", "float32", 64 << 20, progress=False, quantize="none"
    )
    gpu = Engine.from_path(default_model, "cuda", "bfloat16", 64 << 20, progress=False)
    ids = prompt(64, cpu.config.vocab_size)
    table = list(range(4))
    want = cpu.model.logits(cpu.forward([SeqInput("s", ids, 0, table)]))
    got = gpu.model.logits(gpu.forward([SeqInput("s", ids, 0, table)])).cpu()
    assert rel(got, want) < 6e-2
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) > 0.9


def decode_logits(engine: Engine, ids: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill each sequence, then `steps` greedy decode steps of the whole batch."""
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(ids))]
    last = [
        engine.step([SeqInput(f"s{i}", p, 0, tables[i])])[0].token_id for i, p in enumerate(ids)
    ]
    logits = []
    for step in range(steps):
        batch = [SeqInput(f"s{i}", [last[i]], len(p) + step, tables[i]) for i, p in enumerate(ids)]
        graph = engine._graph_outputs(batch, None)
        row = graph.logits if graph is not None else engine.model.logits(engine.forward(batch))
        logits.append(row.float().cpu())
        last = row.argmax(-1).tolist()
    return logits


def test_cuda_graph_replay_equals_eager(default_model: Path) -> None:
    graphed = Engine.from_path(
        default_model, "cuda", "bfloat16", 256 << 20, progress=False, max_num_seqs=8
    )
    eager = Engine(graphed.loaded, graphed.num_kv_blocks, graphed.block_size, 8, cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    ids = [prompt(n, graphed.config.vocab_size) for n in (5, 40, 100)]
    for a, b in zip(decode_logits(graphed, ids, 6), decode_logits(eager, ids, 6), strict=True):
        assert rel(a, b) < 1e-2
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_graphs_of_32_to_128_rows_capture_cublaslt_products_then_restore_the_default() -> None:
    from engine.graph_blas import LT_ROWS, products_for_rows

    default = torch.backends.cuda.preferred_blas_library()
    x = torch.randn(64, 512, device=CUDA, dtype=torch.bfloat16)
    w = torch.randn(384, 512, device=CUDA, dtype=torch.bfloat16)
    with products_for_rows(64, CUDA):
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
        lt = torch.nn.functional.linear(x, w)
    assert torch.backends.cuda.preferred_blas_library() == default
    for rows in (LT_ROWS.start - 1, LT_ROWS.stop):
        with products_for_rows(rows, CUDA):
            assert torch.backends.cuda.preferred_blas_library() == default
    assert rel(lt, x.float() @ w.float().t()) < 1e-2


def test_mixed_steps_through_piecewise_graphs_equal_eager(default_model: Path) -> None:
    """Steps with prompts, chunks and decodes (and one past every bucket): the piecewise graphs'
    hidden states and logits against the same steps launched eagerly."""
    graphed = Engine.from_path(
        default_model, "cuda", "bfloat16", 256 << 20, progress=False, max_num_seqs=8
    )
    assert graphed.piecewise is not None
    eager = Engine(graphed.loaded, graphed.num_kv_blocks, graphed.block_size, 8, cuda_graphs=False)
    assert eager.piecewise is None
    vocab = graphed.config.vocab_size
    tables = [list(range(i * 40, i * 40 + 40)) for i in range(3)]
    steps = [
        [
            SeqInput("a", prompt(7, vocab), 0, tables[0]),
            SeqInput("b", prompt(100, vocab), 0, tables[1]),
        ],
        [
            SeqInput("a", [11], 7, tables[0]),
            SeqInput("b", prompt(30, vocab), 100, tables[1]),
            SeqInput("c", prompt(9, vocab), 0, tables[2]),
        ],
        [SeqInput("a", [12], 8, tables[0]), SeqInput("c", prompt(600, vocab), 9, tables[2])],
    ]
    for batch in steps:
        got, want = graphed.forward(batch), eager.forward(batch)
        assert rel(got, want) < 2e-2
        a, b = graphed.model.logits(got), eager.model.logits(want)
        assert rel(a, b) < 2e-2
        assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.9


def test_row_gemv_matches_reference() -> None:
    import torch.nn.functional as F

    from engine.kernels.row_gemv import NORM, RESIDUAL, SWIGLU, row_gemv

    torch.manual_seed(0)
    bf16 = dict(device=CUDA, dtype=torch.bfloat16)
    for n, k in [(4096, 4096), (6144, 4096), (4096, 14336), (1000, 576)]:
        x, res, g = torch.randn(1, k, **bf16), torch.randn(1, n, **bf16), torch.randn(k, **bf16)
        w, gate_up_w = torch.randn(n, k, **bf16), torch.randn(2 * n, k, **bf16)
        normed = F.rms_norm(x.float(), (k,), None, 1e-5).to(torch.bfloat16) * g
        gate_up = (normed.float() @ gate_up_w.float().t()).to(torch.bfloat16).float()
        swiglu = F.silu(gate_up[:, :n]) * gate_up[:, n:]
        y_ref = (x.float() @ w.float().t()).to(torch.bfloat16)
        for pdl in (False, True):
            y, _ = row_gemv(x, w, prologue=NORM, norm_weight=g, eps=1e-5, pdl=pdl)
            assert rel(y, normed.float() @ w.float().t()) < 1e-2
            stream, squares = row_gemv(x, w, epilogue=RESIDUAL, residual=res, pdl=pdl)
            assert rel(stream, y_ref.float() + res.float()) < 1e-2 and squares is not None
            assert rel(squares.sum(), stream.float().square().sum()) < 1e-5
            h, _ = row_gemv(x, gate_up_w, prologue=NORM, norm_weight=g, eps=1e-5,
                            epilogue=SWIGLU, pdl=pdl)  # fmt: skip
            assert rel(h, swiglu) < 2e-2
            y, _ = row_gemv(x, w, out_dtype=torch.float32, pdl=pdl)
            assert y.dtype == torch.float32 and rel(y, x.float() @ w.float().t()) < 1e-3
            # Int8 weights, a scale per row (the byte permute in inline PTX, on the GPU only).
            q = torch.randint(-128, 128, (2 * n, k), device=CUDA, dtype=torch.int8)
            scale = torch.rand(2 * n, **bf16) + 0.5
            wq = q.float() * scale.float()[:, None]
            y, _ = row_gemv(x, q, scale, prologue=NORM, norm_weight=g, eps=1e-5,
                            out_dtype=torch.float32, pdl=pdl)  # fmt: skip
            assert rel(y, normed.float() @ wq.t()) < 1e-3
            h, _ = row_gemv(x, q, scale, prologue=NORM, norm_weight=g, eps=1e-5,
                            epilogue=SWIGLU, pdl=pdl)  # fmt: skip
            gate_up = (normed.float() @ wq.t()).to(torch.bfloat16).float()
            assert rel(h, F.silu(gate_up[:, :n]) * gate_up[:, n:]) < 2e-2
            y, _ = row_gemv(x, q[:n].contiguous(), scale[:n].contiguous(), out_dtype=torch.float32,
                            pdl=pdl)  # fmt: skip
            assert rel(y, x.float() @ wq[:n].t()) < 1e-3
            # FP8 weights (widened by the hardware's conversion), a scale per row.
            f8 = (torch.randn(2 * n, k, device=CUDA) * 64).to(torch.float8_e4m3fn)
            wf = f8.float() * scale.float()[:, None]
            y, _ = row_gemv(x, f8, scale, prologue=NORM, norm_weight=g, eps=1e-5,
                            out_dtype=torch.float32, pdl=pdl)  # fmt: skip
            assert rel(y, normed.float() @ wf.t()) < 1e-5
            stream, _ = row_gemv(x, f8[:n].contiguous(), scale[:n].contiguous(),
                                 epilogue=RESIDUAL, residual=res, pdl=pdl)  # fmt: skip
            want = (x.float() @ wf[:n].t()).to(torch.bfloat16).float() + res.float()
            assert rel(stream, want) < 1e-2


def test_the_dp4a_row_kernel_matches_its_reference() -> None:
    """bench/int8_activations.py's int8 × int8 kernel with the hardware's dp4a (the interpreter
    runs shifts instead) at the LLaMA-3-8B shapes it is timed at."""
    from bench.int8_activations import quantize_groups, w8a8_gemv, w8a8_reference

    torch.manual_seed(0)
    for n, k in [(6144, 4096), (4096, 14336)]:
        w = torch.randint(-128, 128, (n, k), device=CUDA, dtype=torch.int8)
        scale = torch.rand(n, device=CUDA) + 0.1
        x = torch.randn(k, device=CUDA)
        for group, broadcast, tile in [(16, False, (8, 1024, 4)), (32, True, (16, 2048, 8))]:
            xq, xs = quantize_groups(x, group)
            got = w8a8_gemv(xq, xs, w, scale, group=group, tile=tile, broadcast=broadcast)
            assert rel(got, w8a8_reference(xq, xs, w, scale, group)) < 1e-5


def test_tensor_core_int8_products_match_reference() -> None:
    import torch.nn.functional as F

    from engine.kernels import row_gemv_tc as tc
    from engine.kernels.row_gemv import NORM, SWIGLU, row_gemv

    assert tc.available(CUDA)
    torch.manual_seed(0)
    bf16 = dict(device=CUDA, dtype=torch.bfloat16)
    for n, k in [(1024, 4096), (4096, 4096), (512, 14336), (64, 512)]:
        x, g = torch.randn(1, k, **bf16), torch.rand(k, **bf16) + 0.5
        q = torch.randint(-128, 128, (2 * n, k), device=CUDA, dtype=torch.int8)
        scale = (torch.rand(2 * n, **bf16) + 0.5) / 64
        wq = q.float() * scale.float()[:, None]
        normed = (F.rms_norm(x.float(), (k,), None, 1e-5).to(torch.bfloat16) * g).float()
        gate_up = (normed @ wq.t()).to(torch.bfloat16).float()
        swiglu = F.silu(gate_up[:, :n]) * gate_up[:, n:]
        # The sum of squares from partial sums (as O and down leave it), or from x itself.
        parts = x.float().square().view(8, -1).sum(1)
        for squares in (None, parts):
            for pdl in (False, True):
                assert tc.fits(2 * n, k, SWIGLU, g) and tc.fits(2 * n, k, tc.STORE, g)
                kw = dict(norm_weight=g, squares=squares, eps=1e-5, pdl=pdl)
                h, _ = tc.row_gemv_tc(x, q, scale, epilogue=SWIGLU, **kw)
                assert h.shape == (1, n) and rel(h, swiglu) < 1e-2
                # Rounded as row_gemv rounds: the two agree to a bf16 step or so.
                h_row, _ = row_gemv(x, q, scale, prologue=NORM, epilogue=SWIGLU, **kw)
                assert rel(h, h_row) < 1e-2
                y, _ = tc.row_gemv_tc(x, q, scale, out_dtype=torch.float32, **kw)
                assert y.dtype == torch.float32 and rel(y, normed @ wq.t()) < 1e-4
                # FP8 weights: every e4m3 value is an fp16 one, so as exact as int8's.
                f8 = (torch.randn(2 * n, k, device=CUDA) * 64).to(torch.float8_e4m3fn)
                wf = f8.float() * scale.float()[:, None]
                y, _ = tc.row_gemv_tc(x, f8, scale, out_dtype=torch.float32, **kw)
                assert rel(y, normed @ wf.t()) < 1e-4
                h, _ = tc.row_gemv_tc(x, f8, scale, epilogue=SWIGLU, **kw)
                h_row, _ = row_gemv(x, f8, scale, prologue=NORM, epilogue=SWIGLU, **kw)
                assert rel(h, h_row) < 1e-2


def test_greedy_picks_in_the_graph_equal_the_sampler(default_model: Path) -> None:
    from engine.sampling import Sampler
    from engine.sampling_params import GREEDY

    engine = Engine.from_path(
        default_model, "cuda", "bfloat16", 256 << 20, progress=False, max_num_seqs=8
    )
    ids = [prompt(n, engine.config.vocab_size) for n in (5, 40, 100)]
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(3)]
    for n in (1, 3):  # the fused batch-1 graph, and a bucket of the model's modules
        for i in range(n):
            engine.step([SeqInput(f"s{i}", ids[i], 0, tables[i])])
        batch = [SeqInput(f"s{i}", [7], len(ids[i]), tables[i]) for i in range(n)]
        graph = engine._graph_outputs(batch, None)
        assert graph is not None
        want = Sampler()(graph.logits, [GREEDY] * n, [0] * n, [None] * n)
        assert torch.equal(graph.tokens, want.token_ids)
        assert torch.equal(graph.picks[:, 0].long(), want.token_ids)
        assert torch.allclose(graph.picks[:, 1], want.logprobs.double(), atol=1e-5)
        # Through step(): the same tokens, and the logprobs the sampler gives.
        picked = engine.step(batch)
        assert [o.token_id for o in picked] == want.token_ids.tolist()
        assert [o.logprob for o in picked] == pytest.approx(want.logprobs.tolist(), abs=1e-5)
        engine.release([f"s{i}" for i in range(n)])


def test_greedy_picks_of_nan_logits_are_still_token_ids() -> None:
    from engine.kernels.greedy import GreedyPicks

    # Broken weights give NaN logits: the pick must still be an id the next step can embed.
    picks = GreedyPicks(2, 128256, CUDA)
    tokens, _ = picks(torch.full((2, 128256), float("nan"), device=CUDA))
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 128256
    assert not picks.counters.any()


def test_batch1_graph_of_fused_row_kernels_is_as_close_to_fp32_as_eager(
    default_model: Path,
) -> None:
    cpu = Engine.from_path(
        default_model, "cpu", "float32", 64 << 20, progress=False, quantize="none"
    )
    for quantize in ("auto", "int8"):  # both through the fused row kernels
        graphed = Engine.from_path(
            default_model, "cuda", "bfloat16", 64 << 20, progress=False, max_num_seqs=1,
            quantize=quantize,
        )  # fmt: skip
        assert graphed.graphs is not None
        assert graphed.graphs.row is not None
        eager = Engine(graphed.loaded, graphed.num_kv_blocks, graphed.block_size, 1, False)
        table = list(range(8))
        for engine in (graphed, eager, cpu):
            engine.step([SeqInput("s", prompt(40, graphed.config.vocab_size), 0, table)])
        # The same tokens into all three, 30 steps: contexts that open, fill and cross
        # partitions of the attention kernel.
        ours, theirs = [], []
        for i, token in enumerate(prompt(30, graphed.config.vocab_size)):
            batch = [SeqInput("s", [token], 40 + i, table)]
            a = graphed._graph_outputs(batch, None)
            assert a is not None
            got = a.logits[0].float().cpu()
            eager_logits = eager.model.logits(eager.forward(batch))[0].float().cpu()
            want = cpu.model.logits(cpu.forward(batch))[0]
            ours.append(l2(got, want))
            theirs.append(l2(eager_logits, want))
            # The modules round logits to bf16, which makes ties: the graph's choice must be a
            # top logit of theirs to within that rounding.
            top = float(eager_logits.max())
            spacing = 2.0 ** (math.floor(math.log2(abs(top))) - 7)
            assert float(eager_logits[got.argmax()]) >= top - spacing
        # Within bf16 tolerance: on average as far from fp32 as the model's own bf16 modules
        # (step by step the two trade places: 0.0023-0.0083 against 0.0029-0.0067 on an H200).
        assert sum(ours) <= 1.5 * sum(theirs) + 0.03, (ours, theirs)
        cpu.release(["s"])


# Block tables of a step at position pos: every block from the start; grown a step early as
# the scheduler grows them (services/scheduler/running.py); grown only when the position needs it.
TABLES = {
    "held": lambda pos: list(range(8)),
    "early": lambda pos: list(range(-(-(pos + 2) // 16))),
    "on need": lambda pos: list(range(-(-(pos + 1) // 16))),
}


def test_replaying_the_next_step_ahead_changes_no_token(default_model: Path) -> None:
    engine = Engine.from_path(
        default_model, "cuda", "bfloat16", 64 << 20, progress=False, max_num_seqs=1
    )
    assert engine.graphs is not None
    graphs = engine.graphs
    replays = 0
    plain_run = graphs.run

    def counted(*inputs: Any) -> GraphOutputs:
        nonlocal replays
        replays += 1
        return plain_run(*inputs)

    graphs.run = counted  # type: ignore[method-assign]
    ids = prompt(40, engine.config.vocab_size)
    runs, counts = [], {}
    for ahead, tables in [(True, "held"), (True, "early"), (True, "on need"), (False, "held")]:
        replays = 0
        out = engine.step([SeqInput("s", ids, 0, TABLES[tables](39))])[0]
        assert engine._ahead is None  # a prefill is never followed
        got = [(out.token_id, out.logprob)]
        for i in range(60):
            batch = [SeqInput("s", [got[-1][0]], 40 + i, TABLES[tables](40 + i))]
            out = engine.step(batch)[0]
            got.append((out.token_id, out.logprob))
            if not ahead:
                engine._ahead = None  # replayed, never asked for: must leave no trace
        engine.release(["s"])
        runs.append(got)
        counts[ahead, tables] = replays
    assert all(run == runs[0] for run in runs)
    # Ahead, a step is replayed on request only where the one before could not follow it: the
    # first, and, where the table grows only on need, those whose position opens a block (48,
    # 64, 80, 96).
    assert counts == {
        (True, "held"): 1,
        (True, "early"): 1,
        (True, "on need"): 5,
        (False, "held"): 60,
    }, counts


@pytest.mark.parametrize("quantize", ["auto", "int8", "fp8"])
def test_row_kernels_on_8b_shapes_equal_eager(
    tandem_home: Path, tmp_path: Path, quantize: str
) -> None:
    # The 8B shapes with 4 of the 32 layers: bf16 rounding grows with depth through random
    # weights, and the shapes, not the depth, are what the kernels must get right. Int8 and
    # fp8: the graph's gate/up (and int8's head) run on the tensor cores (row_gemv_tc.py), the
    # eager model's modules on engine/kernels/w8a16.py.
    folder = tmp_path / "llama3-8b-4-layers"
    shutil.copytree(registry.resolve("llama3-8b-random", tandem_home), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    graphed = Engine.from_path(
        folder, "cuda", "bfloat16", 1 << 30, progress=False, max_num_seqs=1, quantize=quantize
    )
    row = graphed.graphs.row if graphed.graphs is not None else None
    assert row is not None
    assert all(row.gate_up_tc) == (quantize != "auto")
    assert row.head_tc == (quantize == "int8")  # fp8 keeps the head in bf16
    eager = Engine(graphed.loaded, graphed.num_kv_blocks, graphed.block_size, 1, False)
    # The same tokens into both (random weights leave near-ties that bf16 rounding may flip).
    ids, table = prompt(100, graphed.config.vocab_size), list(range(16))
    for engine in (graphed, eager):
        engine.step([SeqInput("s", ids, 0, table)])
    for i, token in enumerate(prompt(12, graphed.config.vocab_size)):
        batch = [SeqInput("s", [token], 100 + i, table)]
        a = graphed._graph_outputs(batch, None)
        b = eager.model.logits(eager.forward(batch))
        assert a is not None and l2(a.logits, b) < 2e-2


def test_random_8b_shaped_model_agrees_with_transformers(tandem_home: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.random_weights import RandomWeights

    path = registry.resolve("llama3-8b-random", tandem_home)
    ours = Engine.from_path(path, "cuda", "bfloat16", 1 << 30, progress=False, max_num_seqs=4)
    config = LlamaConfig.from_pretrained(path)
    with torch.device("meta"):
        reference = LlamaForCausalLM(config)
    # The very same bf16 weights, computed in fp32: the reference our bf16 arithmetic must meet.
    source = RandomWeights(ours.config, 0, CUDA, torch.bfloat16)
    state = {name: source.get(name).float() for name in source.names()}
    reference.load_state_dict(state, assign=True, strict=False)
    reference.model.rotary_emb = type(reference.model.rotary_emb)(config=config, device=CUDA)
    reference.eval()
    ids = prompt(48, ours.config.vocab_size)
    tokens = torch.tensor([ids], device=CUDA)
    with torch.no_grad():
        want = reference(tokens).logits[0].float()
        # transformers' own bf16 arithmetic on the same weights: what "bf16 tolerance" means
        # for 32 layers of random weights.
        theirs = reference.to(torch.bfloat16)(tokens).logits[0].float()
    got = ours.model.logits(ours.forward([SeqInput("s", ids, 0, list(range(4)))])).float()

    def l2(a: torch.Tensor) -> float:
        return float((a - want).norm() / want.norm())

    assert l2(got) <= 1.5 * l2(theirs) + 1e-3, (l2(got), l2(theirs))


def test_int8_model_stays_close_to_bf16(default_model: Path) -> None:
    bf16 = Engine.from_path(
        default_model, "cuda", "bfloat16", 64 << 20, progress=False, max_num_seqs=4
    )
    int8 = Engine.from_path(
        default_model, "cuda", "bfloat16", 64 << 20, progress=False, max_num_seqs=4, quantize="int8"
    )
    assert int8.loaded.linear_format == "int8"
    ids = prompt(64, bf16.config.vocab_size)
    a = bf16.model.logits(bf16.forward([SeqInput("s", ids, 0, list(range(4)))]))
    b = int8.model.logits(int8.forward([SeqInput("s", ids, 0, list(range(4)))]))
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.85


@pytest.mark.parametrize("m", [1, 16, 17, 64, 65, 512])
def test_fp8_linear_matches_bf16_and_fp32_references(m: int) -> None:
    """Up to FP8_SMALL_M rows the weight-only kernel (fp8 widened in registers), beyond it the FP8
    tensor cores with per-token activation scales: each against the exact product of its own
    fp8 operands, and within e4m3's rounding of the float weights' product in fp32 and bf16."""
    from engine.kernels.w8a16 import FP8_SMALL_M
    from engine.quant import FP8_MAX, Fp8Linear, to_fp8

    torch.manual_seed(0)
    n, k = 4096, 4096
    weight = torch.randn(n, k, device=CUDA) * torch.rand(n, 1, device=CUDA)
    layer = Fp8Linear(weight.bfloat16())
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    w = layer.weight.float() * layer.scale[:, None]
    if m <= FP8_SMALL_M:
        exact = x.float() @ w.t()
    else:
        from engine.kernels.fp8_rows import rows_to_fp8

        row_scale = x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX
        codes, scales = rows_to_fp8(x)  # what the layer multiplies: torch's rounding, exactly
        assert torch.equal(scales, row_scale)
        assert torch.equal(codes.view(torch.uint8), to_fp8(x, row_scale).view(torch.uint8))
        exact = (to_fp8(x, row_scale).float() * row_scale) @ w.t()
    assert l2(out, exact) < 1e-2
    assert l2(out, x.float() @ weight.t()) < 5e-2
    assert l2(out, (x @ weight.bfloat16().t())) < 5e-2


def test_an_fp8_pool_is_stored_and_read_as_its_bf16_values_rounded() -> None:
    """The fused RoPE-and-store writes K and V into an fp8 pool saturating; the paged decode
    kernel reading it equals attention over the same fp8 values widened."""
    from engine.kernels import fused
    from engine.kernels.paged_decode import PagedDecode, Tiling
    from engine.kv_cache import to_kv

    torch.manual_seed(0)
    heads, kv_heads, hd, bs, blocks = 32, 8, 128, 16, 64
    fp8 = torch.float8_e4m3fn
    pool = torch.zeros(blocks * bs, 2, kv_heads, hd, device=CUDA, dtype=fp8)
    qkv = torch.randn(bs * 4, heads + 2 * kv_heads, hd, device=CUDA, dtype=torch.bfloat16)
    qkv[0, heads, 0] = 1000.0  # beyond e4m3's range: saturates to 448
    ones = torch.ones(bs * 4, hd, device=CUDA, dtype=torch.bfloat16)
    slots = torch.randperm(blocks * bs, device=CUDA)[: bs * 4]
    fused.rope_and_store(qkv, ones, 0 * ones, pool, slots, heads, kv_heads)
    want = to_kv(qkv[:, heads:].reshape(-1, 2, kv_heads, hd), fp8)
    assert torch.equal(pool[slots].view(torch.uint8), want.view(torch.uint8))
    assert float(pool[slots[0], 0, 0, 0].float()) == 448.0

    pool = to_kv(torch.randn(blocks * bs, 2, kv_heads, hd, device=CUDA), fp8)
    ctx = torch.tensor([1, 17, 300, 1000], device=CUDA)
    tables = torch.arange(4 * 64, device=CUDA).remainder(blocks).view(4, 64)
    q = torch.randn(4, heads, hd, device=CUDA, dtype=torch.bfloat16)
    # The bf16 pool's tiling, the fp8 pool's for 4 sequences (four warps), and for many (two).
    kernels = [
        PagedDecode(4, heads, kv_heads, hd, bs, 1024, CUDA),
        PagedDecode(4, heads, kv_heads, hd, bs, 1024, CUDA, kv_dtype=fp8),
        PagedDecode(4, heads, kv_heads, hd, bs, 1024, CUDA, 64, Tiling(128, 2, True, 2)),
    ]
    assert kernels[1].tiling(4) == Tiling(128, 4, True, 2)
    assert PagedDecode(64, heads, kv_heads, hd, bs, 1024, CUDA, kv_dtype=fp8).tiling(64) == (
        Tiling(128, 2, True, 2)
    )
    for kernel in kernels:
        out = kernel(q, pool, tables, ctx)
        for i in range(4):
            c = int(ctx[i])
            pos = torch.arange(c, device=CUDA)
            slots = tables[i][pos // bs] * bs + pos % bs
            k = pool[slots, 0].float().repeat_interleave(heads // kv_heads, 1)
            v = pool[slots, 1].float().repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("hd,chd->hc", q[i].float(), k) / math.sqrt(hd)
            assert rel(out[i], torch.einsum("hc,chd->hd", scores.softmax(-1), v)) < 2e-2


def test_fp8_graphs_equal_eager_and_stay_close_to_bf16(default_model: Path) -> None:
    """The default model with FP8 weights and an FP8 KV cache: graph replays equal eager steps,
    and its greedy picks mostly agree with bf16's over the same decode steps."""
    fp8 = Engine.from_path(
        default_model,
        "cuda",
        "bfloat16",
        256 << 20,
        progress=False,
        max_num_seqs=8,
        quantize="fp8",
        kv_cache_dtype="fp8",
    )
    assert fp8.loaded.linear_format == "fp8" and fp8.kv.pool.dtype == torch.float8_e4m3fn
    assert fp8.graphs is not None
    eager = Engine(fp8.loaded, fp8.num_kv_blocks, fp8.block_size, 8, False, torch.float8_e4m3fn)
    ids = [prompt(n, fp8.config.vocab_size) for n in (5, 40, 100)]
    graphed = decode_logits(fp8, ids, 6)
    for a, b in zip(graphed, decode_logits(eager, ids, 6), strict=True):
        assert rel(a, b) < 1e-2
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    from engine.tokenizer import load_tokenizer

    bf16 = Engine.from_path(default_model, "cuda", "bfloat16", 256 << 20, progress=False)
    table = list(range(8))
    # A real prompt (bench/quality.py: 88% top-1 agreement over chat prompts): random tokens
    # leave the model near-ties that any change of rounding flips.
    text = (
        "Explain how a rainbow forms, and why the sky is blue. Then write a Python function "
        "that checks whether a number is prime, and name the capital of Australia."
    )
    chunk = load_tokenizer(default_model).encode_chat([{"role": "user", "content": text}])
    a = bf16.model.logits(bf16.forward([SeqInput("s", chunk, 0, table)]))
    b = fp8.model.logits(fp8.forward([SeqInput("s", chunk, 0, table)]))
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.7


@pytest.mark.parametrize("config", ["cuda 512 1", "cuda 256 2 ahead=2 flag=1", "cuda 512 1 deep=4"])
def test_persistent_cuda_layers_agree_with_the_launched_chain(config: str) -> None:
    """bench/persistent_layers.cu (NVRTC) against the engine's row kernels on two int8 layers of
    LLaMA-3-8B shapes: every barrier completes and the stream agrees (another summation order)."""
    from bench.persistent_layers import EPS, LLAMA3_8B, Layers, relative_error
    from bench.persistent_layers_cuda import CudaConfig, persistent

    layers = Layers(LLAMA3_8B, 2, CUDA)
    run, completed, _ = persistent(layers, CudaConfig.parse(config), EPS)
    got = run()
    assert completed()
    assert relative_error(got, layers.launched()) < 2e-2


def test_the_split_mlp_chain_agrees_with_the_launched_chain() -> None:
    """bench/split_mlp.py (the MLP in one kernel, down's partial outputs added atomically) on two
    int8 layers of LLaMA-3-8B shapes against the engine's row kernels: its fp32 stream agrees
    with the launched chain's bf16 one to bf16's rounding, over another summation order."""
    from bench.persistent_layers import LLAMA3_8B, Layers, relative_error
    from bench.split_mlp import SplitConfig, split_chain

    layers = Layers(LLAMA3_8B, 2, CUDA)
    got = split_chain(layers, SplitConfig.parse("32 gu=16,1024 down=512 4"))()
    assert relative_error(got, layers.launched()) < 2e-2
