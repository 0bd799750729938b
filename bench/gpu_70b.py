"""LLaMA-3-70B shapes in weight-only int8 on one GPU: batch-1 decode against the HBM roofline.

    python -m bench.gpu_70b [--json PATH] [--steps N] [--sweep-seconds S]

`llama3-70b-random` (seeded random weights) is drawn on the GPU a projection at a time and
quantized as it is built (engine/weights.py): neither the host nor the GPU ever holds its 141 GB
of bf16. Rows: the start-up; batch-1 decode through the engine and through its captured graph
alone, against the HBM roofline (bytes a step reads ÷ a device-to-device copy's bandwidth,
measured here); each product of a layer alone, 80 layers' weights in a row so none is read
from L2, against the same bandwidth; and, for the remaining seconds, other tiles of the row_gemv
products. Imports engine code only (torch, numpy, triton, gguf), for a GPU image without the
services' packages. Writes JSON after every row, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    sys.exit("run this benchmark as a module: python -m bench.gpu_70b")

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from bench.cli import first_paragraph, json_option
from bench.gpu_measure import batch1_decode, copy_bandwidth, graph_only, weight_bytes
from engine import registry
from engine.engine import Engine
from engine.kernels import row_gemv_tc as tc
from engine.kernels.row_gemv import NORM, RESIDUAL, STORE, SWIGLU, row_gemv
from engine.quant import Int8Linear
from engine.row_decode import RowDecoder

MODEL = "llama3-70b-random"
TILES = [
    (4, 2048, 4),
    (8, 2048, 4),
    (16, 2048, 4),
    (8, 1024, 4),
    (16, 1024, 4),
    (8, 4096, 4),
    (4, 4096, 4),
    (32, 512, 4),
    (8, 2048, 8),
]


class Report:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {}

    def fact(self, **facts: Any) -> None:
        self.facts.update(facts)
        print(" ".join(f"{k}={v}" for k, v in facts.items()), flush=True)
        self._write()

    def row(self, case: str, value: float, unit: str, ceiling: float = 0.0, **extra: Any) -> None:
        ratio = value / ceiling if ceiling else None
        self.rows.append(
            {
                "case": case,
                "value": value,
                "unit": unit,
                "ceiling": ceiling or None,
                "ratio": ratio,
                **extra,
            }
        )
        shown = f"{ratio:6.1%} of {ceiling:.1f}" if ratio is not None else ""
        print(f"{case:<52} {value:>10.1f} {unit:<6} {shown}", flush=True)
        self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({**self.facts, "rows": self.rows}, indent=2))


def graphed_seconds(launches: list[Callable[[], Any]], repeats: int = 5) -> float:
    """Seconds per launch of `launches` captured back to back in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for launch in launches[:2]:  # compile before capture
            launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats / len(launches)


def products(engine: Engine, row_decoder: RowDecoder) -> dict[str, Callable[..., list[Any]]]:
    """Each product of a batch-1 step as the row decoder launches it, over every layer's weights
    (the head's eight times): name → (tile → launches)."""
    model, pdl, eps, c = engine.model, row_decoder.pdl, engine.config.rms_norm_eps, engine.config
    x = torch.randn(1, c.dim, device="cuda", dtype=torch.bfloat16)
    heads = torch.randn(1, c.q_dim, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(1, c.ffn_dim, device="cuda", dtype=torch.bfloat16)
    blocks = model.blocks()
    context = 640  # a batch-1 decode's RoPE, K/V store and attention, mid-way through the bench
    qkv = torch.randn(1, c.n_heads + 2 * c.n_kv_heads, c.head_dim, device="cuda").bfloat16()
    blocks_a_row = -(-c.max_seq_len // engine.block_size)
    table = (torch.arange(blocks_a_row, device="cuda") % engine.num_kv_blocks)[None]  # (1, max)
    ctx = torch.tensor([context], device="cuda")
    slot = ctx - 1

    def w(module: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(module, Int8Linear)
        return module.weight, module.scale

    def normed(module: Any, norm: torch.Tensor, on_tc: bool, tile: Any, **kw: Any) -> Any:
        if on_tc:
            return partial(tc.row_gemv_tc, x, *w(module), norm_weight=norm, eps=eps, pdl=pdl, **kw)
        return partial(
            row_gemv, x, *w(module), prologue=NORM, norm_weight=norm, eps=eps, pdl=pdl, tile=tile,
            **kw,
        )  # fmt: skip

    def residual(module: Any, inputs: torch.Tensor, tile: Any) -> Any:
        return partial(
            row_gemv, inputs, *w(module), epilogue=RESIDUAL, residual=x, pdl=pdl, tile=tile
        )

    return {
        "QKV": lambda t: [
            normed(b.attention.wqkv, b.attention_norm.weight, False, t) for b in blocks
        ],
        "O": lambda t: [residual(b.attention.wo, heads, t) for b in blocks],
        "gate/up": lambda t: [
            normed(
                b.feed_forward.w13, b.ffn_norm.weight, row_decoder.gate_up_tc[0], t, epilogue=SWIGLU
            )
            for b in blocks
        ],
        "down": lambda t: [residual(b.feed_forward.w2, hidden, t) for b in blocks],
        "attention": lambda t: [
            partial(
                row_decoder.attention,
                qkv,
                model.inv_freq,
                engine.kv.layer(i),
                table,
                ctx,
                slot,
                pdl=pdl,
            )
            for i in range(c.n_layers)
        ],
        "head": lambda t: (
            8
            * [
                normed(
                    model.output,
                    model.norm.weight,
                    row_decoder.head_tc,
                    t,
                    epilogue=STORE,
                    out_dtype=torch.float32,
                )
            ]
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    json_option(parser, "gpu_70b.json")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--sweep-seconds", type=float, default=60.0, help="0: no tile sweep")
    args = parser.parse_args()
    report = Report(args.json)
    bandwidth = copy_bandwidth()
    torch.cuda.empty_cache()
    report.fact(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        copy_bandwidth_bytes_per_s=bandwidth,
    )

    folder = Path(tempfile.mkdtemp(prefix="tandem-70b-"))
    model = registry.RANDOM_MODELS[MODEL]
    registry.write_random_config(model, folder)  # no tokenizer: token ids are all we feed it
    started = time.perf_counter()
    engine = Engine.from_path(
        folder,
        "cuda",
        "bfloat16",
        kv_cache_bytes=4 << 30,
        progress=False,
        max_num_seqs=1,
        quantize="int8",
        warm_up_tokens=None,
    )
    torch.cuda.synchronize()
    read = weight_bytes(engine)
    report.fact(
        step_read_bytes=read,
        gpu_memory_allocated=torch.cuda.memory_allocated(),
        gpu_memory_peak=torch.cuda.max_memory_allocated(),
        linear_format=engine.loaded.linear_format,
        row_kernels=engine.graphs is not None and engine.graphs.row is not None,
    )
    report.row(
        "70B int8 start-up (load, graphs)",
        time.perf_counter() - started,
        "s",
        **{f"{k}_s": v for k, v in engine.start_times.items()},
    )
    roofline = bandwidth / read
    for label in ("first", "second", "third"):
        rate = batch1_decode(engine, 512, args.steps)
        report.row(
            f"70B int8 batch-1 decode, engine ({label})",
            rate,
            "tok/s",
            roofline,
        )
    rate = graph_only(engine, 512, args.steps)
    report.row(
        "70B int8 batch-1 decode, graph replay alone",
        rate,
        "tok/s",
        roofline,
    )

    row_decoder = engine.graphs.row if engine.graphs is not None else None
    if row_decoder is None:
        return
    kinds = products(engine, row_decoder)
    total = 0.0
    for name, launches in kinds.items():
        try:
            seconds = graphed_seconds(launches(None))
        except Exception as err:  # the rows above stand; say which product failed, go on
            report.row(f"70B int8 {name} product alone", 0.0, "GB/s", error=repr(err)[:300])
            continue
        total += seconds * (1 if name == "head" else engine.config.n_layers)
        if name == "attention":  # the context's K and V, bf16
            report.row("70B int8 attention alone, context 640", seconds * 1e6, "us")
            continue
        module = {
            "QKV": engine.model.blocks()[0].attention.wqkv,
            "O": engine.model.blocks()[0].attention.wo,
            "gate/up": engine.model.blocks()[0].feed_forward.w13,
            "down": engine.model.blocks()[0].feed_forward.w2,
            "head": engine.model.output,
        }[name]
        nbytes = module.weight.numel() + 2 * cast(torch.Tensor, module.scale).numel()
        report.row(
            f"70B int8 {name} product alone",
            nbytes / seconds / 1e9,
            "GB/s",
            bandwidth / 1e9,
            us=seconds * 1e6,
            shape=list(module.weight.shape),
        )
    report.fact(kernels_alone_step_ms=total * 1000)

    deadline = time.perf_counter() + args.sweep_seconds
    for name in ("QKV", "O", "down"):
        for tile in TILES:
            if time.perf_counter() > deadline:
                return
            try:
                seconds = graphed_seconds(kinds[name](tile))
            except Exception as err:  # a tile the kernel cannot take: note it, try the next
                report.row(f"sweep {name} {tile}", 0.0, "us", error=repr(err)[:200])
                continue
            report.row(f"sweep {name} {tile}", seconds * 1e6, "us")


if __name__ == "__main__":
    main()
