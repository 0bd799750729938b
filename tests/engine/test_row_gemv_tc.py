"""The tensor-core int8 and fp8 products (engine/kernels/row_gemv_tc.py) where no GPU is: which
products may take them, and that the kernel builds for Hopper as designed. Their arithmetic is
checked on the GPU (tests/gpu/test_cuda.py: test_tensor_core_int8_products_match_reference)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import row_gemv_tc as tc


def test_fits_needs_whole_tiles_and_inputs_inside_fp16() -> None:
    g = torch.ones(4096)
    assert tc.fits(28672, 4096, tc.SWIGLU, g)  # LLaMA-3-8B gate/up
    assert tc.fits(128256, 4096, tc.STORE, g)  # and its head
    assert not tc.fits(3072, 576, tc.SWIGLU, torch.ones(576))  # SmolLM2: 576 is no tile width
    assert not tc.fits(1000, 4096, tc.STORE, g)  # rows short of a tile
    assert not tc.fits(64, 256, tc.STORE, torch.ones(256))  # fewer than two tiles along K
    # rms_norm(x) * g reaches sqrt(K) * max |g|: 64 * 1100 does not fit in fp16.
    assert tc.fits(4096, 4096, tc.STORE, torch.full((4096,), 1000.0))
    assert not tc.fits(4096, 4096, tc.STORE, torch.full((4096,), -1100.0))


def test_kernel_builds_for_hopper_on_the_tensor_cores() -> None:
    """Compiled for sm_90 here (ptxas ships with Triton): the products are mma.sync on fp16,
    and the only shared memory is the staged input: the weights reach the mma's layout in
    registers, not through shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    k = 4096
    mma, frag, loaded, inputs = tc._layouts(tc.BK, tc.WARPS)
    pointers = {"x_ptr": "*bf16", "g_ptr": "*bf16", "sq_ptr": "*fp32", "w_ptr": "*i32",
                "s_ptr": "*bf16", "out_ptr": "*bf16"}  # fmt: skip
    for epilogue, n_sq, fp8 in (
        (tc.SWIGLU, 256, False),
        (tc.STORE, 0, False),
        (tc.SWIGLU, 0, True),
    ):
        constants = dict(
            K=k, N_SQ=n_sq, EPILOGUE=epilogue, TN=tc.BN, TK=tc.BK, PDL=True, MMA=mma,
            FRAG=frag, LOADED=loaded, INPUTS=inputs, FP8=fp8,
        )  # fmt: skip
        signature = {**pointers, "N": "i32", "eps": "fp32", **dict.fromkeys(constants, "constexpr")}
        fn = tc._row_gemv_tc
        aligned = {(fn.arg_names.index(p),): [["tt.divisibility", 16]] for p in pointers}
        kernel = triton.compile(
            GluonASTSource(fn, signature, constants, aligned),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": tc.WARPS},
        )
        ptx = kernel.asm["ptx"]
        # A tile is BK / 16 m16n8k16 steps a warp; the loop and its two peeled tiles.
        assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") >= 3 * tc.BK // 16
        assert "griddepcontrol.wait" in ptx
        # e4m3 weights widen by the hardware's pair conversion, int8 ones by byte permutes.
        assert ("cvt.rn.f16x2.e4m3x2" in ptx) == fp8 and ("prmt.b32" in ptx) != fp8
        assert kernel.metadata.shared == k * 6  # x and g as copied, the fp16 input: nothing else


def test_decoder_falls_back_to_row_gemv_where_the_kernel_does_not_build(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Gluon is experimental: where another Triton cannot build the kernel, the batch-1
    decoder logs it and serves those products with row_gemv.py, from that call on."""
    import ast

    from triton.compiler.errors import CompilationError

    from engine import row_decode
    from engine.quant import Int8Linear

    def does_not_build(*args: object, **kwargs: object) -> None:
        raise CompilationError("", ast.parse("x"), "AttributeError('no thread_barrier')")

    served: list[dict[str, object]] = []

    def row_gemv(*args: object, **kwargs: object) -> tuple[str, None]:
        served.append(kwargs)
        return "row_gemv", None

    monkeypatch.setattr(row_decode.tc, "row_gemv_tc", does_not_build)
    monkeypatch.setattr(row_decode, "row_gemv", row_gemv)
    decoder = row_decode.RowDecoder.__new__(row_decode.RowDecoder)  # no model, no GPU needed
    decoder.eps, decoder.pdl, decoder.gate_up_tc, decoder.head_tc = 1e-5, False, [True] * 2, True
    module, norm = Int8Linear(torch.randn(128, 512)), torch.ones(512)
    with caplog.at_level("WARNING"):
        out = decoder._normed(True, torch.randn(1, 512), module, norm, None, epilogue=tc.SWIGLU)
    assert out == ("row_gemv", None) and served[0]["epilogue"] == tc.SWIGLU
    assert decoder.gate_up_tc == [False, False] and not decoder.head_tc
    assert "row_gemv serves them" in caplog.text and "no thread_barrier" in caplog.text
