"""Int8 weights at batch 1, each LLaMA-3-8B product alone: the engine's kernel (int8 weights
times bf16 inputs) against the same loads with no arithmetic and against int8 inputs with dp4a:
whether the widening arithmetic is what keeps int8 batch-1 below the memory's pace.

The engine's int8 row kernel (engine/kernels/row_gemv.py) spends a byte permute and an FMA on
every weight. Beside it, at each tile: "stream", the same weight loads with one integer XOR a
word and no product (the loads' own pace); "dp4a", inputs quantised to int8 in groups of G with
a float scale each (as llama.cpp's q8_0 activations), so that G weights cost G / 4 dp4a (four
byte products and their sum in one instruction), a conversion and an FMA ("bcast": each row's
copy of the inputs loaded in the weights' own layout, no trip through shared memory); the
engine's kernel at each tile, plain and with its product's own prologue and epilogue ("engine
fused"); and the engine's bf16 kernel over the same bytes (the ramp and tail of a product that
size). Launched with programmatic dependent launch, timed in CUDA graphs over copies of the
weights larger than L2 together, against the copy rate.

    python -m bench.int8_activations [--shapes qkv,o,gate/up,down] [--modes stream,engine,...]
        [--rounds 2] [--json PATH]

On an H100 (bench/RESULTS-gpu.md, session 64) the arithmetic was not the limit: dp4a was no
faster than the engine at its best tiles, the loads alone only a few points faster, and what
the engine lost was its inputs, read one 2-byte load at a time; read as 64-bit words they took
int8 QKV from 75% to 82% and O from 68% to 74% of the copy rate.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from typing import Any

import torch
import triton
import triton.language as tl

from bench.cli import first_paragraph, json_option, write_json

DIM, FFN, QKV = 4096, 14336, 6144
SHAPES = {"qkv": (QKV, DIM), "o": (DIM, DIM), "gate/up": (2 * FFN, DIM), "down": (DIM, FFN)}
DOT, STREAM = 0, 1
TILES = list(itertools.product([8, 16], [1024, 2048], [4, 8]))  # (BN, BK, warps)
GROUPS = (8, 16, 32)
# label: (group, activations loaded for every row); "stream" has no product
MODES = {
    "stream": (16, False),
    "dp4a G=16": (16, False),
    "dp4a G=16 bcast": (16, True),
    "dp4a G=32 bcast": (32, True),
}


@triton.jit
def _dot4(w, a, acc, ASM: tl.constexpr):
    """acc + the sum of the four signed byte products of words w and a."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [w, a, acc],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    for byte in tl.static_range(4):  # the CPU interpreter: shifts sign-extend each byte
        acc += ((w << (24 - 8 * byte)) >> 24) * ((a << (24 - 8 * byte)) >> 24)
    return acc


@triton.jit
def _tile(acc, w, xq_ptr, xs_ptr, k0, BK: tl.constexpr, G: tl.constexpr, MODE: tl.constexpr,
          ASM: tl.constexpr, BCAST: tl.constexpr):  # fmt: skip
    """acc with one weight tile taken in: w (BN, BK / G, G / 4) words at input k0."""
    if MODE == 1:  # STREAM
        acc = acc ^ w
    else:
        C: tl.constexpr = BK // G
        WORDS: tl.constexpr = G // 4
        cw = k0 // 4 + tl.arange(0, C)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
        if BCAST:  # loaded for every row, in the weights' own layout (no shuffle, more loads)
            a = tl.load(xq_ptr + (cw[None, :, :] + 0 * w))
        else:
            a = tl.load(xq_ptr + cw)[None, :, :]  # (C, WORDS) words of four int8 inputs
        dots = tl.sum(_dot4(w, a, tl.zeros(w.shape, tl.int32), ASM), 2)
        acc += dots.to(tl.float32) * tl.load(xs_ptr + k0 // G + tl.arange(0, C))[None, :]
    return acc


@triton.jit
def _w8a8_gemv(
    xq_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    G: tl.constexpr, MODE: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
    BCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    # A tile: BN rows, BK / G groups, G / 4 words of four weights.
    C: tl.constexpr = BK // G
    words = tl.arange(0, C)[:, None] * (G // 4) + tl.arange(0, G // 4)[None, :]
    tile = w_ptr + rn.to(tl.int64)[:, None, None] * (K // 4) + words[None, :, :]
    w = tl.load(tile, eviction_policy="evict_first")
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 1:  # noqa: SIM108 (two types: Triton's jit takes no conditional expression)
        acc = tl.zeros([BN, C, G // 4], tl.int32)
    else:
        acc = tl.zeros([BN, C], tl.float32)
    acc = _tile(acc, w, xq_ptr, xs_ptr, 0, BK, G, MODE, ASM, BCAST)
    for k0 in range(BK, K, BK):
        w = tl.load(tile + k0 // 4, eviction_policy="evict_first")
        acc = _tile(acc, w, xq_ptr, xs_ptr, k0, BK, G, MODE, ASM, BCAST)
    if MODE == 1:
        y = tl.xor_sum(tl.xor_sum(acc, 2), 1).to(tl.float32)
    else:
        y = tl.sum(acc, 1) * tl.load(s_ptr + rn)
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty))


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (K,) as int8 in groups of `group` inputs, each with the scale amax / 127: (K,) int8 and
    (K / group,) fp32."""
    g = x.float().view(-1, group)
    scale = g.abs().amax(1) / 127
    q = torch.round(g / scale.clamp_min(1e-30)[:, None]).clamp(-127, 127).to(torch.int8)
    return q.view(-1), scale


def w8a8_reference(
    xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int
) -> torch.Tensor:
    """What w8a8_gemv computes, in fp32 with torch."""
    n = weight.shape[0]
    per_group = (weight.float().view(n, -1, group) * xq.float().view(-1, group)).sum(2)
    return scale.float() * (per_group * xs.float()).sum(1)


def w8a8_gemv(
    xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
    group: int, tile: tuple[int, int, int], stream: bool = False, pdl: bool = False,
    broadcast: bool = False,
) -> torch.Tensor:  # fmt: skip
    """y (N,) fp32 = scale * Σ_g xs_g Σ_{k in g} weight[:, k] xq[k]: weight (N, K) int8 with a
    scale a row, xq (K,) int8 in groups of `group` with scales xs. stream: the loads only (timing);
    broadcast: each row's program loads the activations in the weights' layout."""
    n, k = weight.shape
    bn, bk, warps = tile
    assert n % bn == 0 and k % bk == 0 and bk % group == 0 and group in GROUPS
    out = torch.empty(n, dtype=torch.float32, device=weight.device)
    _w8a8_gemv[(n // bn,)](
        xq.view(torch.int32), xs, weight.view(torch.int32), scale, out, K=k, BN=bn, BK=bk,
        G=group, MODE=STREAM if stream else DOT, ASM=weight.is_cuda, PDL=pdl, BCAST=broadcast,
        num_warps=warps,
        launch_pdl=pdl,
    )  # fmt: skip
    return out


def measure(name: str, bandwidth: float, modes: list[str], rounds: int) -> list[dict[str, Any]]:
    from bench import row_tiles
    from engine.kernels.row_gemv import NORM, RESIDUAL, row_gemv

    n, k = SHAPES[name]
    w = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8)
    scale = torch.rand(n, device="cuda") / 64 + 1e-3
    copies = [w] + [w.clone() for _ in range(row_tiles.L2_PASS // w.numel())]
    x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(n, k // 2, device="cuda", dtype=torch.bfloat16)  # the same bytes in bf16
    bf16_copies = [wb] + [wb.clone() for _ in range(row_tiles.L2_PASS // w.numel())]
    xb = torch.randn(1, k // 2, device="cuda", dtype=torch.bfloat16)
    # The engine's own prologue and epilogue for this product ("engine fused").
    _, _, prologue, epilogue = row_tiles.SHAPES[name]
    fused: dict[str, Any] = dict(epilogue=epilogue)
    if prologue == NORM:
        fused.update(prologue=NORM, norm_weight=(torch.rand(k, device="cuda") + 0.5).bfloat16(),
                     eps=1e-5)  # fmt: skip
    if epilogue == RESIDUAL:
        fused["residual"] = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    candidates: list[tuple[str, list[Any]]] = [
        ("engine int8 × bf16, its tile", [functools.partial(row_gemv, x[None], c, scale, pdl=True)
                                          for c in copies]),
        ("engine bf16, same bytes", [functools.partial(row_gemv, xb, c, pdl=True)
                                     for c in bf16_copies]),
    ]  # fmt: skip
    for (bn, bk, warps), mode in itertools.product(TILES, modes):
        tile = (bn, bk, warps)
        if bk > k or n % bn:
            continue
        if mode.startswith("engine"):
            engine = functools.partial(row_gemv, x[None], scale=scale, tile=tile, pdl=True,
                                       **(fused if "fused" in mode else {}))  # fmt: skip
            candidates.append((f"{mode} {tile}", [functools.partial(engine, weight=c)
                                                  for c in copies]))  # fmt: skip
            continue
        group, broadcast = MODES[mode]
        xq, xs = quantize_groups(x, group)
        gemv = functools.partial(
            w8a8_gemv, xq, xs, scale=scale, group=group, tile=tile, stream=mode == "stream",
            broadcast=broadcast, pdl=True,
        )  # fmt: skip
        candidates.append((f"{mode} {tile}", [functools.partial(gemv, c) for c in copies]))
    rows = []
    for turn, (label, calls) in itertools.product(range(rounds), candidates):
        try:
            seconds = row_tiles.graph_seconds(calls)
        except Exception as err:  # a tile this shape cannot take: note it, go on
            print(f"{name:<8} {label:<34} failed: {type(err).__name__}: {err}"[:200], flush=True)
            continue
        share = n * k / seconds / bandwidth
        print(f"{name:<8} {label:<34} {seconds * 1e6:>8.2f} {share:>8.1%}", flush=True)
        rows.append(dict(shape=name, kernel=label, round=turn, seconds=seconds, share=share))
    return rows


def main() -> None:
    from bench.gpu_measure import copy_bandwidth

    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    engine = "engine (row_gemv at each tile), engine fused (with the product's own ends)"
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}, {engine}")
    parser.add_argument("--rounds", type=int, default=1, help="times each candidate is timed")
    json_option(parser, "int8_activations.json")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s")
    print(f"{'shape':<8} {'kernel (BN, BK, warps)':<34} {'µs':>8} {'of copy':>8}")
    rows = []
    for name in args.shapes.split(","):
        rows += measure(name, bandwidth, args.modes.split(","), args.rounds)
    write_json(args.json, {"copy_bandwidth": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
