"""The batch-1 row kernels (engine/kernels/row_gemv.py, row_gemv_tc.py) at the LLaMA-3-8B shapes:
each weight format through each tile, timed inside CUDA graphs (a Triton launch from Python costs
more host time than these kernels take on the GPU), against the device's copy bandwidth.

    python -m bench.row_tiles [--formats fp8,int8] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import itertools
from typing import Any

import torch

from bench.cli import first_paragraph, json_option, write_json
from bench.gpu_measure import copy_bandwidth
from engine.kernels import row_gemv_tc as tc
from engine.kernels.row_gemv import NORM, PLAIN, RESIDUAL, STORE, SWIGLU, _tile, row_gemv

DIM, FFN, QKV, VOCAB = 4096, 14336, 6144, 128256
# name: (N, K, prologue, epilogue); gate/up is 2 × FFN rows of gate then up.
SHAPES = {
    "qkv": (QKV, DIM, NORM, STORE),
    "o": (DIM, DIM, PLAIN, RESIDUAL),
    "gate/up": (2 * FFN, DIM, NORM, SWIGLU),
    "down": (DIM, FFN, PLAIN, RESIDUAL),
    "head": (VOCAB, DIM, NORM, STORE),
}
GRIDS = {  # (BN, BK, warps) tried beside each format's default
    "bf16": list(itertools.product([2, 4, 8], [1024, 2048, 4096], [4, 8])),
    "int8": list(itertools.product([8, 16, 32], [512, 1024, 2048], [4, 8])),
    "fp8": list(itertools.product([4, 8, 16], [1024, 2048, 4096], [4, 8])),
}
REPEATS = 20
L2_PASS = 200 << 20


def graph_seconds(calls: list[Any]) -> float:
    """Seconds a call takes, the calls replayed in turn REPEATS times inside one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for call in calls:
            call()  # compiles and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPEATS):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / (5 * REPEATS)


def weights(fmt: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if fmt == "bf16":
        return w, None
    scale = torch.rand(n, device="cuda") / 64 + 1e-3
    if fmt == "int8":
        return torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8), scale
    return (w * 64).to(torch.float8_e4m3fn), scale


def measure(name: str, fmt: str, bandwidth: float) -> list[dict[str, Any]]:
    """One shape in one weight format: every tile of row_gemv, and row_gemv_tc where it fits."""
    n, k, prologue, epilogue = SHAPES[name]
    w, scale = weights(fmt, n, k)
    # Copies enough to pass through more than the L2 cache (50 MB on an H200) before one is
    # read again, as a decode step reads each weight once.
    copies = [w] + [w.clone() for _ in range(L2_PASS // (w.numel() * w.element_size()))]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    g = (torch.rand(k, device="cuda") + 0.5).bfloat16()
    kw: dict[str, Any] = dict(epilogue=epilogue, pdl=True)
    if prologue == NORM:
        kw.update(prologue=NORM, norm_weight=g, eps=1e-5)
    if epilogue == RESIDUAL:
        kw["residual"] = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    default = _tile(n, k, 0 if fmt == "fp8" else w.element_size())
    tiles = [default] + [t for t in GRIDS[fmt] if t != default and t[1] <= 2 * k]
    candidates: list[tuple[str, list[Any]]] = []
    for t in tiles:
        if epilogue != SWIGLU or t[0] % 2 == 0:
            label = f"row_gemv {t}{' default' if t == default else ''}"
            gemv = functools.partial(row_gemv, x, scale=scale, tile=t, **kw)
            candidates.append((label, [functools.partial(gemv, c) for c in copies]))
    on_tc = prologue == NORM and tc.available(x.device) and tc.fits(n, k, epilogue, g)
    if scale is not None and on_tc:
        gemv_tc = functools.partial(
            tc.row_gemv_tc, x, scale=scale, norm_weight=g, eps=1e-5, epilogue=epilogue, pdl=True
        )
        candidates.append(("row_gemv_tc", [functools.partial(gemv_tc, weight=c) for c in copies]))
    rows = []
    for label, calls in candidates:
        try:
            seconds = graph_seconds(calls)
        except Exception as err:  # a tile this shape cannot take: note it, go on
            print(f"{name:<8} {fmt:<5} {label:<28} failed: {type(err).__name__}: {err}"[:200])
            continue
        share = w.numel() * w.element_size() / seconds / bandwidth  # as bench.gpu's roofline
        print(f"{name:<8} {fmt:<5} {label:<28} {seconds * 1e6:>8.1f} {share:>8.1%}", flush=True)
        rows.append(dict(shape=name, format=fmt, kernel=label, seconds=seconds, share=share))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--formats", default="bf16,int8,fp8")
    json_option(parser, "row_tiles.json")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s")
    print(f"{'shape':<8} {'format':<5} {'kernel':<28} {'µs':>8} {'of copy':>8}")
    rows = []
    for name, fmt in itertools.product(SHAPES, args.formats.split(",")):
        rows += measure(name, fmt, bandwidth)
    write_json(args.json, {"copy_bandwidth": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
