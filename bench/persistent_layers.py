"""A layer's int8 batch-1 products in one persistent kernel, chained through LLaMA-3-8B-shaped
layers, against the same chain as the engine launches it: whether a layer's fixed costs (each
product's ramp and tail, ~17 µs of an int8 layer's 68 on an H200) shrink when the products stop
being kernels of their own.

Per layer, as engine/row_decode.py without attention (O reads the first 4,096 QKV outputs):
QKV (RMSNorm in front), O (residual behind), gate/up (RMSNorm in front, SiLU·up behind), down
(residual behind). The launched chain is row_gemv / row_gemv_tc with programmatic dependent
launch, in a CUDA graph. The persistent kernel runs a fixed number of programs that stay
resident; each takes a product's row tiles in turn (tile = program id, then every P-th), and
between products they wait at a barrier (a counter in global memory), each program's first
weight tile of the next product already requested: the weights never depend on the barrier.
Each layer writes its own activation buffers, so no program can read a line its L1 cached
before another program wrote it.

    python -m bench.persistent_layers [--layers 16] [--config "528 4 qkv=8,1024 ..."] [--json PATH]

The same layers also run in a persistent kernel written in CUDA (bench/persistent_layers.cu, a
config that starts with "cuda": bench/persistent_layers_cuda.py says how it reads).

A config is the number of programs, warps a program, then tiles (rows, inputs) by product;
"stages=N" to copy a tile's later weights into shared memory N - 1 chunks ahead, "regs=N" to cap
the registers a thread (Triton's maxnreg: more programs an SM, spills past it), and "late" to
request each product's first tile after its barrier instead of before.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from bench.cli import first_paragraph, json_option, write_json
from engine.kernels import row_gemv_tc as tc
from engine.kernels.row_gemv import (
    _ONE,
    NORM,
    RESIDUAL,
    SWIGLU,
    _int8_product,
    _rstd,
    row_gemv,
)

EPS = 1e-5
_SPINS: tl.constexpr = tl.constexpr(200_000)  # polls before a barrier gives up: not all resident


@dataclass(frozen=True)
class Shapes:
    dim: int
    qkv: int
    ffn: int

    def layer_bytes(self) -> int:
        return self.dim * (self.qkv + self.dim + 2 * self.ffn) + self.ffn * self.dim


LLAMA3_8B = Shapes(4096, 6144, 14336)


@dataclass(frozen=True)
class Config:
    programs: int
    warps: int
    tiles: dict[str, tuple[int, int]]  # qkv, o, gu, down: (rows, inputs) a tile
    ahead: bool = True  # each product's first tile requested before its barrier ("late": after)
    stages: int = 0  # >1: a tile's later weights copied into shared memory that many ahead
    regs: int = 0  # >0: registers a thread at most (spills past it), so more programs fit an SM

    @classmethod
    def parse(cls, text: str) -> Config:
        programs, warps, *tiles = text.split()
        late = "late" in tiles
        pairs = dict(t.split("=") for t in tiles if t != "late")
        stages = int(pairs.pop("stages", 0))
        regs = int(pairs.pop("regs", 0))
        shape = {k: (int(v.split(",")[0]), int(v.split(",")[1])) for k, v in pairs.items()}
        assert set(shape) == {"qkv", "o", "gu", "down"}, f"tiles for qkv, o, gu, down: {text}"
        return cls(int(programs), int(warps), shape, not late, stages, regs)

    def __str__(self) -> str:
        tiles = " ".join(f"{k}={r},{c}" for k, (r, c) in self.tiles.items())
        stages = f" stages={self.stages}" if self.stages else ""
        regs = f" regs={self.regs}" if self.regs else ""
        late = "" if self.ahead else " late"
        return f"{self.programs} {self.warps} {tiles}{stages}{regs}{late}"


@triton.jit
def _barrier(count_ptr, target, failed_ptr):
    """Arrive, then wait until `target` arrivals have been counted since the kernel began. One
    thread does the atomics (Triton's choice for a scalar); the CTA barrier first makes the
    other threads' stores part of what its release publishes."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < _SPINS):
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        tl.store(failed_ptr, 1)


@triton.jit
def _rows(w_ptr, tile, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, GU: tl.constexpr):
    """A tile's weight rows (words of four int8), their row numbers and which exist. Gate/up
    tiles alternate a gate row and its up row (N gate rows, then N up rows)."""
    t = tl.arange(0, BN)
    if GU:
        half = tile * (BN // 2) + t // 2
        rn = half + (t % 2) * N
        exists = half < N
    else:
        rn = tile * BN + t
        exists = rn < N
    return w_ptr + rn.to(tl.int64)[:, None] * (K // 4), rn, exists


@triton.jit
def _first(rows, exists, BK: tl.constexpr):
    cols = tl.arange(0, BK // 4)
    return tl.load(rows + cols[None, :], mask=exists[:, None], other=0,
                   eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _tile(
    first, rows, rn, tile, x_ptr, g_ptr, sq_ptr, s_ptr, res_ptr, out_ptr, sq_out_ptr, eps, one,
    N: tl.constexpr, K: tl.constexpr, PROLOGUE: tl.constexpr, N_SQ: tl.constexpr,
    EPILOGUE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """One tile of a product, its first weight words in hand, through row_gemv's epilogues."""
    cols = tl.arange(0, BK // 4)
    rstd = 1.0
    if PROLOGUE == 1:
        rstd = _rstd(x_ptr, sq_ptr, eps, K, N_SQ, BK)
    acc = tl.zeros([BN, BK // 4], tl.float32)
    sums = tl.zeros([BK // 4], tl.float32)
    acc, sums = _int8_product(
        acc, sums, first, one, x_ptr, g_ptr, 0, rstd, K, PROLOGUE, BK, True, ASM
    )
    for k0 in tl.range(BK, K, BK, num_stages=STAGES):
        w = tl.load(rows + (k0 // 4 + cols)[None, :], eviction_policy="evict_first")
        acc, sums = _int8_product(
            acc, sums, w, one, x_ptr, g_ptr, k0, rstd, K, PROLOGUE, BK, True, ASM
        )
    total = tl.sum(sums, 0)
    y = (32768.0 * (tl.sum(acc, 1) - total) - 128.0 * total) * tl.load(s_ptr + rn)
    dt = out_ptr.dtype.element_ty
    if EPILOGUE == 1:  # RESIDUAL
        stream = (y.to(dt).to(tl.float32) + tl.load(res_ptr + rn).to(tl.float32)).to(dt)
        tl.store(out_ptr + rn, stream)
        sf = stream.to(tl.float32)
        tl.store(sq_out_ptr + tile, tl.sum(sf * sf, 0))
    elif EPILOGUE == 2:  # SWIGLU
        gate, up = tl.split(tl.reshape(y.to(dt).to(tl.float32), [BN // 2, 2]))
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + tile * (BN // 2) + tl.arange(0, BN // 2), h.to(dt))
    else:
        tl.store(out_ptr + rn, y.to(dt))


@triton.jit
def _product(
    first, pid, programs, x_ptr, g_ptr, sq_ptr, w_ptr, s_ptr, res_ptr, out_ptr, sq_out_ptr, eps,
    one, N: tl.constexpr, K: tl.constexpr, PROLOGUE: tl.constexpr, N_SQ: tl.constexpr,
    EPILOGUE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """This program's tiles of one product: its own id's (first words in hand), then every
    `programs`-th."""
    GU: tl.constexpr = EPILOGUE == 2
    TILES: tl.constexpr = N // (BN // 2) if GU else N // BN
    if pid < TILES:
        rows, rn, _ = _rows(w_ptr, pid, N, K, BN, GU)
        _tile(first, rows, rn, pid, x_ptr, g_ptr, sq_ptr, s_ptr, res_ptr, out_ptr, sq_out_ptr,
              eps, one, N, K, PROLOGUE, N_SQ, EPILOGUE, BN, BK, ASM, STAGES)  # fmt: skip
    for tile in range(pid + programs, TILES, programs):
        rows, rn, exists = _rows(w_ptr, tile, N, K, BN, GU)
        first = _first(rows, exists, BK)
        _tile(first, rows, rn, tile, x_ptr, g_ptr, sq_ptr, s_ptr, res_ptr, out_ptr, sq_out_ptr,
              eps, one, N, K, PROLOGUE, N_SQ, EPILOGUE, BN, BK, ASM, STAGES)  # fmt: skip


@triton.jit
def _next(
    w_ptr, pid, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GU: tl.constexpr, more, count_ptr, target, failed_ptr, AHEAD: tl.constexpr,
):  # fmt: skip
    """The barrier before a product, and this program's first weight words of it: requested
    before the barrier (AHEAD) or after. `more`: whether the product exists at all."""
    rows, _, exists = _rows(w_ptr, pid, N, K, BN, GU)
    if AHEAD:
        first = _first(rows, exists & more, BK)
        _barrier(count_ptr, target, failed_ptr)
    else:
        _barrier(count_ptr, target, failed_ptr)
        first = _first(rows, exists & more, BK)
    return first


@triton.jit
def _layers(
    x_ptr, sq_ptr, qkv_ptr, h_ptr, hsq_ptr, act_ptr, wqkv_ptr, sqkv_ptr, wo_ptr, so_ptr,
    wgu_ptr, sgu_ptr, wd_ptr, sd_ptr, gattn_ptr, gffn_ptr, count_ptr, failed_ptr, eps, one,
    LAYERS: tl.constexpr, DIM: tl.constexpr, QKV: tl.constexpr, FFN: tl.constexpr,
    BN_QKV: tl.constexpr, BK_QKV: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
    BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
    ASM: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    SQ_O: tl.constexpr = DIM // BN_O  # partial sums of squares of O's stream, one a tile
    SQ_D: tl.constexpr = DIM // BN_D
    rows, _, exists = _rows(wqkv_ptr, pid, QKV, DIM, BN_QKV, False)
    first_qkv = _first(rows, exists, BK_QKV)
    arrived = 0
    for layer in range(LAYERS):
        at = tl.cast(layer, tl.int64)
        x, sq = x_ptr + at * DIM, sq_ptr + at * SQ_D
        qkv, h, act = qkv_ptr + at * QKV, h_ptr + at * DIM, act_ptr + at * FFN
        hsq = hsq_ptr + at * SQ_O
        wqkv, wo = wqkv_ptr + at * (QKV * DIM // 4), wo_ptr + at * (DIM * DIM // 4)
        wgu, wd = wgu_ptr + at * (2 * FFN * DIM // 4), wd_ptr + at * (DIM * FFN // 4)
        gattn, sqkv = gattn_ptr + at * DIM, sqkv_ptr + at * QKV
        _product(first_qkv, pid, programs, x, gattn, sq, wqkv, sqkv, x, qkv, sq, eps, one, QKV,
                 DIM, 1, SQ_D, 0, BN_QKV, BK_QKV, ASM, STAGES)  # fmt: skip
        arrived += programs
        first_o = _next(wo, pid, DIM, DIM, BN_O, BK_O, False, True, count_ptr, arrived,
                        failed_ptr, AHEAD)  # fmt: skip
        _product(first_o, pid, programs, qkv, x, sq, wo, so_ptr + at * DIM, x, h, hsq, eps, one,
                 DIM, DIM, 0, 0, 1, BN_O, BK_O, ASM, STAGES)  # fmt: skip
        arrived += programs
        first_gu = _next(wgu, pid, FFN, DIM, BN_GU, BK_GU, True, True, count_ptr, arrived,
                         failed_ptr, AHEAD)  # fmt: skip
        gffn, sgu = gffn_ptr + at * DIM, sgu_ptr + at * 2 * FFN
        _product(first_gu, pid, programs, h, gffn, hsq, wgu, sgu, h, act, hsq, eps, one, FFN, DIM,
                 1, SQ_O, 2, BN_GU, BK_GU, ASM, STAGES)  # fmt: skip
        arrived += programs
        first_d = _next(wd, pid, DIM, FFN, BN_D, BK_D, False, True, count_ptr, arrived,
                        failed_ptr, AHEAD)  # fmt: skip
        _product(first_d, pid, programs, act, x, sq, wd, sd_ptr + at * DIM, h, x + DIM,
                 sq + SQ_D, eps, one, DIM, FFN, 0, 0, 1, BN_D, BK_D, ASM, STAGES)  # fmt: skip
        arrived += programs
        first_qkv = _next(wqkv + QKV * DIM // 4, pid, QKV, DIM, BN_QKV, BK_QKV, False,
                          layer + 1 < LAYERS, count_ptr, arrived, failed_ptr, AHEAD)  # fmt: skip


class Layers:
    """Random int8 layers of the given shapes, stacked (layer, rows, inputs) for the persistent
    kernel; both chains start from the same stream. Activations in bf16 (fp32 on the CPU, whose
    interpreter has no bf16)."""

    def __init__(self, shapes: Shapes, layers: int, device: torch.device, seed: int = 0) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        d, q, f = shapes.dim, shapes.qkv, shapes.ffn
        self.shapes, self.layers, self.device = shapes, layers, device

        def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
            w = torch.randint(-127, 128, (layers, n, k), generator=gen, device=device)
            scale = (torch.rand(layers, n, generator=gen, device=device) + 0.5) / (127 * k**0.5)
            return w.to(torch.int8), scale

        self.qkv, self.o = weight(q, d), weight(d, d)
        self.gu, self.down = weight(2 * f, d), weight(d, f)
        norms = torch.rand(2, layers, d, generator=gen, device=device) + 0.5
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.attn_norm, self.ffn_norm = norms.to(self.dtype)
        self.x0 = torch.randn(1, d, generator=gen, device=device).to(self.dtype)
        # As engine/row_decode.py: gate/up on the tensor cores where they fit (decided here:
        # `fits` reads the norm weights, which a CUDA graph's capture cannot).
        self.gu_tc = tc.available(device) and all(
            tc.fits(2 * f, d, SWIGLU, g) for g in self.ffn_norm
        )

    def weights(self, name: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's int8 weights of a product (qkv, o, gu, down) and their scales."""
        w, scale = getattr(self, name)
        return w[layer], scale[layer]

    def launched(self) -> torch.Tensor:
        """The stream after every layer, as engine/row_decode.py launches the products."""
        stream, squares = self.x0, None
        pdl = self.device.type == "cuda"
        for i in range(self.layers):
            qkv, _ = row_gemv(
                stream, *self.weights("qkv", i), prologue=NORM,
                norm_weight=self.attn_norm[i], squares=squares, eps=EPS, pdl=pdl,
            )  # fmt: skip
            heads = qkv[:, : self.shapes.dim]
            stream, squares = row_gemv(
                heads, *self.weights("o", i), epilogue=RESIDUAL, residual=stream, pdl=pdl
            )
            (w, s), g = self.weights("gu", i), self.ffn_norm[i]
            if self.gu_tc:
                hidden, _ = tc.row_gemv_tc(
                    stream, w, s, norm_weight=g, squares=squares, eps=EPS, epilogue=SWIGLU,
                    pdl=pdl,
                )  # fmt: skip
            else:
                hidden, _ = row_gemv(
                    stream, w, s, prologue=NORM, norm_weight=g, squares=squares, eps=EPS,
                    epilogue=SWIGLU, pdl=pdl,
                )  # fmt: skip
            stream, squares = row_gemv(
                hidden, *self.weights("down", i), epilogue=RESIDUAL, residual=stream,
                pdl=pdl,
            )  # fmt: skip
        return stream

    def activations(self, sq_x: int, sq_h: int) -> tuple[torch.Tensor, ...]:
        """Every layer's own activation buffers for a persistent kernel: the stream (the first
        one in place) and its sq_x partial sums of squares, QKV, O's stream and its sq_h partial
        sums, and gate/up's output."""
        s, n, device, dt = self.shapes, self.layers, self.device, self.dtype
        x = torch.zeros(n + 1, s.dim, dtype=dt, device=device)
        x[0] = self.x0[0]
        sq = torch.zeros(n + 1, sq_x, dtype=torch.float32, device=device)
        sq[0, 0] = self.x0.float().square().sum()
        qkv = torch.empty(n, s.qkv, dtype=dt, device=device)
        h = torch.empty(n, s.dim, dtype=dt, device=device)
        hsq = torch.empty(n, sq_h, dtype=torch.float32, device=device)
        hidden = torch.empty(n, s.ffn, dtype=dt, device=device)
        return x, sq, qkv, h, hsq, hidden

    def persistent(self, config: Config) -> tuple[Any, Any, list[Any]]:
        """A call that runs the persistent kernel (the stream after every layer is its result),
        a check that its barriers all completed, and (once it has run) the compiled kernel."""
        s, layers, device = self.shapes, self.layers, self.device
        t = config.tiles
        sq_d, sq_o = s.dim // t["down"][0], s.dim // t["o"][0]
        outputs = {"qkv": s.qkv, "o": s.dim, "gu": 2 * s.ffn, "down": s.dim}
        inputs = {"qkv": s.dim, "o": s.dim, "gu": s.dim, "down": s.ffn}
        for name, (rows, width) in t.items():  # the kernel's tiles are whole: no masks
            assert outputs[name] % rows == 0, f"{name}: {outputs[name]} rows in tiles of {rows}"
            assert inputs[name] % width == 0, f"{name}: {inputs[name]} inputs in tiles of {width}"
        x, sq, qkv, h, hsq, act = self.activations(sq_d, sq_o)
        count = torch.zeros(1, dtype=torch.int32, device=device)
        failed = torch.zeros(1, dtype=torch.int32, device=device)
        words = [w.view(torch.int32) for w, _ in (self.qkv, self.o, self.gu, self.down)]

        compiled: list[Any] = []

        def run() -> torch.Tensor:
            count.zero_()
            kernel = _layers[(config.programs,)](
                x, sq, qkv, h, hsq, act, words[0], self.qkv[1], words[1], self.o[1], words[2],
                self.gu[1], words[3], self.down[1], self.attn_norm, self.ffn_norm, count, failed,
                EPS, _ONE, LAYERS=layers, DIM=s.dim, QKV=s.qkv, FFN=s.ffn,
                BN_QKV=t["qkv"][0], BK_QKV=t["qkv"][1], BN_O=t["o"][0], BK_O=t["o"][1],
                BN_GU=t["gu"][0], BK_GU=t["gu"][1], BN_D=t["down"][0], BK_D=t["down"][1],
                ASM=device.type == "cuda", AHEAD=config.ahead, STAGES=config.stages,
                num_warps=config.warps, **({"maxnreg": config.regs} if config.regs else {}),
            )  # fmt: skip
            compiled[:] = [kernel]
            return x[layers : layers + 1]

        def completed() -> bool:
            return not bool(failed.item())

        return run, completed, compiled


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def check_small() -> None:
    """Both chains at small shapes on the CPU (Triton's interpreter, one program: its barriers
    pass at once), several tiles a program, every epilogue; exits non-zero on a mismatch."""
    layers = Layers(Shapes(64, 96, 128), 2, torch.device("cpu"))
    expected = layers.launched()
    for late in ("", " late"):
        config = Config.parse("1 4 qkv=8,32 o=8,64 gu=8,32 down=8,64 stages=3" + late)
        run, completed, _ = layers.persistent(config)
        error = relative_error(run(), expected)
        print(f"persistent layers{late}, interpreter: relative error {error:.2e}")
        assert completed() and error < 2e-2, error


def resident(kernel: Any, warps: int) -> int:
    """Programs of a compiled kernel that fit one SM at once (registers, shared memory, warps)."""
    props = torch.cuda.get_device_properties(0)
    regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * warps)
    shared = kernel.metadata.shared + 1024
    by_shared = getattr(props, "shared_memory_per_multiprocessor", 233472) // shared
    by_warps = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return min(by_regs, by_shared, by_warps, 32)


# Triton: registers decide how many programs stay resident, about 128 a thread for tiles of 512
# inputs (512 programs divide every product's tiles evenly); capping them (regs=) or more stages
# lost on an H100 (bench/RESULTS-gpu.md, session 62). CUDA: one block of 512 threads an SM, one
# unit ahead, and the same with the barriers' waits left out (what the barriers cost).
DEFAULT_CONFIGS = [
    "512 4 qkv=4,512 o=8,512 gu=8,512 down=8,512",
    "512 4 qkv=4,512 o=8,512 gu=8,512 down=8,512 stages=4",
    "cuda 512 1",
    "cuda 256 2",
    "cuda 512 1 ahead=2",
    "cuda 512 1 skip=1",
]


def _cuda(layers: Layers, text: str, expected: torch.Tensor) -> list[tuple[str, Any]]:
    """The CUDA kernel of a "cuda THREADS PER_SM" config, if it builds and runs here."""
    from bench.persistent_layers_cuda import CudaConfig, persistent

    try:
        run, completed, info = persistent(layers, CudaConfig.parse(text), EPS)
        got = run()
        torch.cuda.synchronize()
    except Exception as err:  # a config this GPU cannot build: say so, go on
        print(f"{text}: failed: {type(err).__name__}: {err}"[:600])
        return []
    if not completed():
        print(f"{text}: {info}; a barrier gave up: skipped")
        return []
    print(f"{text}: {info}; error {relative_error(got, expected):.1e}")
    return [(f"persistent {text}", run)]


def time_chains(
    candidates: list[tuple[str, Any]], args: argparse.Namespace, bandwidth: float, floor: float
) -> None:
    """Each chain's time a layer inside CUDA graphs (args.layers layers), printed as a table and
    written to args.json; args.rounds rounds alternate the order (a card that warms up favours
    neither)."""
    from bench.row_tiles import graph_seconds

    width = max(len(label) for label, _ in candidates)
    print(f"{'chain':<{width}} {'round':>5} {'µs a layer':>10} {'of floor':>8}")
    rows = []
    for r in range(args.rounds):
        for label, call in candidates if r % 2 == 0 else candidates[::-1]:
            seconds = graph_seconds([call]) / args.layers
            share = floor / seconds
            print(f"{label:<{width}} {r:>5} {seconds * 1e6:>10.1f} {share:>8.1%}", flush=True)
            rows.append(dict(chain=label, round=r, seconds=seconds, of_floor=share))
    write_json(args.json, dict(device=torch.cuda.get_device_name(), copy_bandwidth=bandwidth,
                               rows=rows, layers=args.layers, floor_seconds=floor))  # fmt: skip


def main() -> None:
    from bench.gpu_measure import copy_bandwidth

    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--config", action="append", help="programs warps qkv=R,C o= gu= down=")
    parser.add_argument("--rounds", type=int, default=2)
    json_option(parser, "persistent_layers.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth()
    shapes = LLAMA3_8B
    floor = shapes.layer_bytes() / bandwidth
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, {sms} SMs; "
          f"a layer's {shapes.layer_bytes() / 1e6:.0f} MB take {floor * 1e6:.1f} µs")  # fmt: skip
    layers = Layers(shapes, args.layers, device)
    expected = layers.launched()
    candidates: list[tuple[str, Any]] = [("launched (the engine's kernels)", layers.launched)]
    for text in args.config or DEFAULT_CONFIGS:
        if text.startswith("cuda"):
            candidates += _cuda(layers, text, expected)
            continue
        config = Config.parse(text)
        run, completed, compiled = layers.persistent(config)
        try:
            got = run()
            torch.cuda.synchronize()
        except Exception as err:  # a config this GPU cannot build: say so, go on
            print(f"{text}: failed: {type(err).__name__}: {err}"[:300])
            continue
        kernel = compiled[0]
        fit = resident(kernel, config.warps) * sms
        if config.programs > fit or not completed():
            print(f"{text}: {config.programs} programs, {fit} resident at most: skipped")
            continue
        error = relative_error(got, expected)
        print(f"{text}: {kernel.n_regs} registers, {fit} resident; error {error:.1e}")
        candidates.append((f"persistent {text}", run))
    time_chains(candidates, args, bandwidth, floor)


if __name__ == "__main__":
    main()
