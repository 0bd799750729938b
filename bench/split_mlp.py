"""A layer's two MLP products in one kernel at batch 1, down split by the features each program
computes and its partial outputs added atomically, chained through LLaMA-3-8B-shaped int8
layers against the chain the engine launches: whether three launches a layer (QKV, O, the MLP)
beat four. The launched chain's fixed costs are a few µs a dependency
(bench/RESULTS-gpu.md, session 62); this removes one of a layer's four without a grid barrier.

Per layer, as bench/persistent_layers.py's launched chain (engine/row_decode.py without
attention), except the MLP: program p takes F features, computes their 2F gate/up rows
(RMSNorm in front) and silu(gate) * up, then multiplies those F values by down's F columns for
every output row and adds its 4,096 partial outputs into the layer's fp32 stream, zeroed
before the chain; program 0 also adds the residual. The next layer's QKV reads that fp32
stream and sums its squares itself (no product wrote partial sums of them).

    python -m bench.split_mlp [--layers 16] [--config "32 gu=16,1024 down=512 4"] [--json PATH]

A config is F (features a program), gate/up's tile (rows, inputs), down's rows a tile, warps,
and "store" to store down's partial outputs instead of adding them (timing only).

They do not: on an H100 the best config took 94.2 µs a layer against the launched chain's 79.9
(bench/RESULTS-gpu.md, session 63); the atomic adds cost 1.5 µs of that, the rest is the
kernel's streaming (gate/up on the CUDA cores instead of the tensor cores, down read F columns
at a time).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bench.cli import first_paragraph, json_option
from bench.persistent_layers import (
    EPS,
    LLAMA3_8B,
    Layers,
    Shapes,
    relative_error,
    time_chains,
)
from engine.kernels.row_gemv import _ONE, NORM, RESIDUAL, _first_ahead, _int8_product, row_gemv


@dataclass(frozen=True)
class SplitConfig:
    features: int  # F: gate/up features a program, and down's columns it multiplies
    gate_up: tuple[int, int]  # (rows, inputs) a tile; rows alternate gate and up
    down_rows: int  # down's rows a tile (F columns wide)
    warps: int
    store: bool = False  # timing only: down's partial outputs stored, not added (wrong results)

    @classmethod
    def parse(cls, text: str) -> SplitConfig:
        features, gu, down, warps, *store = text.split()
        assert gu.startswith("gu=") and down.startswith("down="), f"F gu=R,C down=R warps: {text}"
        assert store in ([], ["store"]), f"only 'store' may follow the warps: {text}"
        rows, inputs = gu[3:].split(",")
        return cls(int(features), (int(rows), int(inputs)), int(down[5:]), int(warps), bool(store))

    def __str__(self) -> str:
        rows, inputs = self.gate_up
        store = " store" if self.store else ""
        return f"{self.features} gu={rows},{inputs} down={self.down_rows} {self.warps}{store}"

    def check(self, shapes: Shapes) -> None:
        f, (rows, inputs) = self.features, self.gate_up
        assert shapes.ffn % f == 0 and f % 4 == 0, f"F={f} must divide {shapes.ffn}, by fours"
        assert (2 * f) % rows == 0 and rows % 2 == 0, f"gate/up tiles of {rows} rows in 2F={2 * f}"
        assert shapes.dim % inputs == 0 and shapes.dim % self.down_rows == 0, str(self)


@triton.jit
def _gate_up(
    h_ptr, sq_ptr, g_ptr, wgu_ptr, sgu_ptr, act_ptr, first_row, eps, one, DIM: tl.constexpr,
    FFN: tl.constexpr, N_SQ: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ASM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """silu(gate) * up for the BN / 2 features from first_row, into act (prologue 1: NORM)."""
    t = tl.arange(0, BN)
    hn = first_row + t // 2
    rn = hn + (t % 2) * FFN
    rows = wgu_ptr + rn.to(tl.int64)[:, None] * (DIM // 4)
    y = _first_ahead(h_ptr, g_ptr, sq_ptr, rows, hn < FFN, eps, one, DIM, 1, N_SQ, BN, BK, True,
                     True, False, ASM, PDL)  # fmt: skip
    dt = h_ptr.dtype.element_ty
    y = (y * tl.load(sgu_ptr + rn)).to(dt).to(tl.float32)
    gate, up = tl.split(tl.reshape(y, [BN // 2, 2]))
    hidden = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + first_row + tl.arange(0, BN // 2), hidden.to(dt))


@triton.jit
def _down_part(
    wd_ptr, sd_ptr, act_ptr, rn, f0, one, FFN: tl.constexpr, F: tl.constexpr,
    BN_D: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """Rows rn of down over the program's F columns, times its F features."""
    cols = tl.arange(0, F // 4)
    words = wd_ptr + rn.to(tl.int64)[:, None] * (FFN // 4) + (f0 // 4 + cols)[None, :]
    w = tl.load(words, eviction_policy="evict_first")
    acc = tl.zeros([BN_D, F // 4], tl.float32)
    sums = tl.zeros([F // 4], tl.float32)
    acc, sums = _int8_product(acc, sums, w, one, act_ptr + f0, act_ptr, 0, 1.0, F, 0, F, True,
                              ASM)  # fmt: skip
    total = tl.sum(sums, 0)
    return (32768.0 * (tl.sum(acc, 1) - total) - 128.0 * total) * tl.load(sd_ptr + rn)


@triton.jit
def _split_mlp(
    h_ptr, sq_ptr, g_ptr, wgu_ptr, sgu_ptr, wd_ptr, sd_ptr, act_ptr, out_ptr, eps, one,
    DIM: tl.constexpr, FFN: tl.constexpr, N_SQ: tl.constexpr, F: tl.constexpr,
    BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr, ASM: tl.constexpr,
    PDL: tl.constexpr, STORE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    f0 = pid * F
    _gate_up(h_ptr, sq_ptr, g_ptr, wgu_ptr, sgu_ptr, act_ptr, f0, eps, one, DIM, FFN, N_SQ,
             BN_GU, BK_GU, ASM, PDL)  # fmt: skip
    for sub in tl.static_range(1, 2 * F // BN_GU):
        _gate_up(h_ptr, sq_ptr, g_ptr, wgu_ptr, sgu_ptr, act_ptr, f0 + sub * (BN_GU // 2), eps,
                 one, DIM, FFN, N_SQ, BN_GU, BK_GU, ASM, False)  # fmt: skip
    tl.debug_barrier()  # the program's F features, stored by all its threads, read by all
    r = tl.arange(0, BN_D)
    for n0 in range(0, DIM, BN_D):
        rn = n0 + r
        y = _down_part(wd_ptr, sd_ptr, act_ptr, rn, f0, one, FFN, F, BN_D, ASM)
        if pid == 0:  # the residual, once
            y += tl.load(h_ptr + rn).to(tl.float32)
        if STORE:  # timing only: what the atomic adds cost
            tl.store(out_ptr + rn, y)
        else:
            tl.atomic_add(out_ptr + rn, y, sem="relaxed")


def split_mlp(
    h: torch.Tensor,
    squares: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    act: torch.Tensor,
    out: torch.Tensor,
    config: SplitConfig,
    pdl: bool,
) -> None:
    """out (1, dim) fp32, zero before: += h + down @ (silu(gate) * up) of rms_norm(h) * g;
    h's sum of squares is the sum of `squares`; act (1, ffn) holds the features. Weights int8
    with a scale a row."""
    (wgu, sgu), (wd, sd) = gate_up, down
    assert wd.dtype == wgu.dtype == torch.int8
    ffn, dim = wd.shape[1], wd.shape[0]
    rows, inputs = config.gate_up
    wgu, wd = wgu.view(torch.int32), wd.view(torch.int32)  # words of four weights
    _split_mlp[(ffn // config.features,)](
        h, squares, norm_weight, wgu, sgu, wd, sd, act,
        out, EPS, _ONE, DIM=dim, FFN=ffn, N_SQ=squares.numel(), F=config.features, BN_GU=rows,
        BK_GU=inputs, BN_D=config.down_rows, ASM=h.is_cuda, PDL=pdl, STORE=config.store,
        num_warps=config.warps, launch_pdl=pdl,
    )  # fmt: skip


def split_chain(layers: Layers, config: SplitConfig) -> Callable[[], torch.Tensor]:
    """A call that runs the layers with the MLP in one kernel; returns the last stream (fp32)."""
    s, device = layers.shapes, layers.device
    config.check(s)
    streams = torch.zeros(layers.layers, s.dim, dtype=torch.float32, device=device)
    act = torch.empty(1, s.ffn, dtype=layers.dtype, device=device)
    pdl = device.type == "cuda"

    def run() -> torch.Tensor:
        streams.zero_()
        stream = layers.x0
        for i in range(layers.layers):
            qkv, _ = row_gemv(
                stream, *layers.weights("qkv", i), prologue=NORM,
                norm_weight=layers.attn_norm[i], eps=EPS, out_dtype=layers.dtype, pdl=pdl,
            )  # fmt: skip
            h, squares = row_gemv(
                qkv[:, : s.dim], *layers.weights("o", i), epilogue=RESIDUAL,
                residual=stream, pdl=pdl,
            )  # fmt: skip
            assert squares is not None
            out = streams[i : i + 1]
            gate_up, down = layers.weights("gu", i), layers.weights("down", i)
            split_mlp(h, squares, layers.ffn_norm[i], gate_up, down, act, out, config, pdl)
            stream = out
        return stream

    return run


def check_small() -> None:
    """The split chain against the launched one at small shapes on the CPU (Triton's
    interpreter); exits non-zero on a mismatch."""
    layers = Layers(Shapes(64, 96, 128), 2, torch.device("cpu"))
    expected = layers.launched()
    for text in ("16 gu=8,32 down=16 4", "32 gu=64,64 down=64 4"):
        error = relative_error(split_chain(layers, SplitConfig.parse(text))(), expected)
        print(f"split MLP {text}, interpreter: relative error {error:.2e}")
        assert error < 2e-2, error


# Tiles of 128 rows or fewer left down's loads too few bytes in flight (104–167 µs a layer on an
# H100); 512 was best, 1,024 slower again.
DEFAULT_CONFIGS = [
    "32 gu=16,1024 down=512 4",
    "32 gu=16,1024 down=512 4 store",
    "64 gu=16,1024 down=512 8",
    "32 gu=16,1024 down=128 4",
]


def main() -> None:
    from bench.gpu_measure import copy_bandwidth

    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--config", action="append", help="F gu=ROWS,INPUTS down=ROWS warps")
    parser.add_argument("--rounds", type=int, default=2)
    json_option(parser, "split_mlp.json")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    layers = Layers(LLAMA3_8B, args.layers, torch.device("cuda"))
    floor = LLAMA3_8B.layer_bytes() / bandwidth
    megabytes = LLAMA3_8B.layer_bytes() / 1e6
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; a layer's "
          f"{megabytes:.0f} MB take {floor * 1e6:.1f} µs")  # fmt: skip
    expected = layers.launched()
    candidates: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("launched (the engine's kernels)", layers.launched)
    ]
    for text in args.config or DEFAULT_CONFIGS:
        try:
            run = split_chain(layers, SplitConfig.parse(text))
            got = run()
            torch.cuda.synchronize()
        except Exception as err:  # a config this GPU cannot build: say so, go on
            print(f"{text}: failed: {type(err).__name__}: {err}"[:300])
            continue
        print(f"{text}: error {relative_error(got, expected):.1e}")
        candidates.append((f"split MLP {text}", run))
    time_chains(candidates, args, bandwidth, floor)


if __name__ == "__main__":
    main()
