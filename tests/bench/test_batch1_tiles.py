"""bench.batch1_tiles's variants: parsed by product name, and set (as are leaving attention out
and the least attention kernel) only while a graph is captured; that kernel's arithmetic in
Triton's interpreter."""

from __future__ import annotations

import argparse

import pytest
import torch
from interpreted import run_interpreted

from bench.batch1_tiles import SHAPES, parse_variant, tiles_of, without_attention
from bench.least_attention import least_attention, least_call
from engine.kernels import row_gemv as rg
from engine.kernels.rope_attention import RopeAttention


def test_a_variant_names_each_products_tile() -> None:
    assert parse_variant("qkv=8,1024,4 o=8,1024,8") == {
        SHAPES["qkv"]: (8, 1024, 4),
        SHAPES["o"]: (8, 1024, 8),
    }


@pytest.mark.parametrize(
    ("text", "named"),
    [("attn=8,1024,4", "unknown product 'attn'"), ("qkv=8,1024", "rows,inputs,warps"),
     ("qkv=8,0,4", "rows,inputs,warps"), ("", "at least one")],
)  # fmt: skip
def test_a_bad_variant_is_refused_by_name(text: str, named: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=named):
        parse_variant(text)


def test_tiles_apply_to_their_shapes_only_and_only_inside() -> None:
    committed_o, committed_down = rg._tile(4096, 4096, 1), rg._tile(4096, 14336, 1)
    with tiles_of({SHAPES["o"]: (4, 512, 2)}):
        assert rg._tile(4096, 4096, 1) == (4, 512, 2)
        assert rg._tile(4096, 14336, 1) == committed_down
    assert rg._tile(4096, 4096, 1) == committed_o


def test_attention_is_left_out_only_inside() -> None:
    original = RopeAttention.__call__
    attention = RopeAttention(1, 8, 2, 16, 16, 64, torch.device("cpu"))
    qkv = torch.zeros(1, 12, 16, dtype=torch.bfloat16)
    with without_attention():
        out = attention(qkv, torch.ones(8), torch.zeros(4, 2, 2, 16), torch.zeros(1, 4),
                        torch.ones(1), torch.zeros(1))  # fmt: skip
        assert out.shape == (1, 8, 16) and out.dtype == torch.bfloat16
    assert RopeAttention.__call__ is original


def test_the_least_attention_kernel_is_launched_only_inside() -> None:
    original = RopeAttention.__call__
    with least_attention():
        assert RopeAttention.__call__ is least_call
    assert RopeAttention.__call__ is original


def test_the_least_attention_kernel_is_attention_over_one_partition_in_the_interpreter() -> None:
    out = run_interpreted("from bench.least_attention import check_small; check_small()")
    assert out.count("max error") == 3
