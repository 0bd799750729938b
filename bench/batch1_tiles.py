"""Batch-1 decode of LLaMA-3-8B shapes with other row-kernel tiles, A/B in one engine: each
variant's graph captured again, variants in turn and then in reverse, so that a card's drift
falls on all of them alike. bench.row_tiles times a product alone; this times the whole step,
where each product overlaps its neighbours.

    python -m bench.batch1_tiles [--quantize int8] [--rounds 2] \
        [--variant "qkv=8,1024,4 o=8,1024,8"] ... [--least-attention] [--without-attention] \
        [--json PATH]

A variant names products (qkv, o, gate_up, down, head) and the (rows, inputs, warps) tile each
takes instead of engine/kernels/row_gemv.py's choice; the committed tiles always run first.
Greedy tokens of a fixed prompt are compared with the committed tiles' (random weights make
near ties, so another summation order may change a token: a note, not an error).
--without-attention adds the committed tiles with no attention kernel in the graph (its output
left unwritten, so the tokens are wrong): the most that any attention kernel could win.
--least-attention adds them with bench/least_attention.py's kernel in its place (no RoPE, no K/V
store, no merge: wrong tokens too): what any attention launch between QKV and O costs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from bench.cli import first_paragraph, json_option, tandem_home, write_json
from bench.gpu_measure import batch1_decode, copy_bandwidth, free, graph_only, weight_bytes
from bench.least_attention import least_attention
from engine import registry
from engine.batch import SeqInput
from engine.engine import Engine
from engine.kernels import row_gemv as rg
from engine.kernels.rope_attention import RopeAttention

DIM, FFN, QKV, VOCAB = 4096, 14336, 6144, 128256
SHAPES = {  # a product's (N, K) as row_gemv sees it
    "qkv": (QKV, DIM),
    "o": (DIM, DIM),
    "gate_up": (2 * FFN, DIM),
    "down": (DIM, FFN),
    "head": (VOCAB, DIM),
}
Tile = tuple[int, int, int]
NO_ATTENTION = "committed, no attention kernel"
LEAST_ATTENTION = "committed, the least attention kernel"


def parse_variant(text: str) -> dict[tuple[int, int], Tile]:
    """A variant's text, "qkv=8,1024,4 o=8,1024,8", as {(N, K): (BN, BK, warps)} for each
    named product's shape."""
    tiles = {}
    for part in text.split():
        name, _, tile = part.partition("=")
        if name not in SHAPES:
            raise argparse.ArgumentTypeError(
                f"unknown product {name!r}: one of {', '.join(SHAPES)}"
            )
        numbers = tile.split(",")
        if len(numbers) != 3 or not all(n.isdigit() and int(n) > 0 for n in numbers):
            raise argparse.ArgumentTypeError(f"{part!r}: a tile is rows,inputs,warps (8,1024,4)")
        bn, bk, warps = (int(n) for n in numbers)
        tiles[SHAPES[name]] = (bn, bk, warps)
    if not tiles:
        raise argparse.ArgumentTypeError("a variant names at least one product's tile")
    return tiles


@contextmanager
def tiles_of(overrides: dict[tuple[int, int], Tile]) -> Iterator[None]:
    """row_gemv's tile choice, with `overrides` for their shapes, while the block runs."""
    chosen = rg._tile

    def tile(n: int, k: int, weight_bytes: int) -> Tile:
        return overrides.get((n, k)) or chosen(n, k, weight_bytes)

    rg._tile = tile
    try:
        yield
    finally:
        rg._tile = chosen


@contextmanager
def without_attention() -> Iterator[None]:
    """While the block runs, RopeAttention returns an unwritten output and launches nothing
    (RoPE, the K/V store and attention all left out of graphs captured then)."""
    call = RopeAttention.__call__

    def unwritten(self: RopeAttention, qkv: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        return torch.empty((qkv.shape[0], self.n_heads, qkv.shape[2]), dtype=qkv.dtype,
                           device=qkv.device)  # fmt: skip

    RopeAttention.__call__ = unwritten  # type: ignore[method-assign]
    try:
        yield
    finally:
        RopeAttention.__call__ = call  # type: ignore[method-assign]


def greedy_tokens(engine: Engine, count: int = 16) -> list[int]:
    ids = list(range(100, 164))
    table = list(range(-(-(len(ids) + count) // engine.block_size)))
    token = engine.step([SeqInput("t", ids, 0, table)])[0].token_id
    tokens = [token]
    for i in range(count - 1):
        token = engine.step([SeqInput("t", [token], len(ids) + i, table)])[0].token_id
        tokens.append(token)
    engine.release(["t"])
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument(
        "--quantize",
        choices=["none", "int8"],
        default="int8",
        help="the weights: int8 with a scale a row (default), or none (bf16)",
    )
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        help='tiles to try, as "qkv=8,1024,4 o=8,1024,8" (products: qkv, o, gate_up, down, '
        "head; a tile: rows,inputs,warps); repeat for more variants",
    )
    parser.add_argument(
        "--without-attention",
        action="store_true",
        help="also the committed tiles with no attention kernel (wrong tokens; an upper bound)",
    )
    parser.add_argument(
        "--least-attention",
        action="store_true",
        help="also the committed tiles with the least attention kernel (wrong tokens; what an "
        "attention launch costs)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="each variant's runs (default 2)")
    parser.add_argument("--steps", type=int, default=128, help="decode steps a run (default 128)")
    json_option(parser, "batch1_tiles.json")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    started = time.time()
    engine = Engine.from_path(
        registry.resolve("llama3-8b-random", tandem_home()), "cuda", "bfloat16",
        kv_cache_bytes=4 << 30, progress=False, max_num_seqs=1,
        quantize=args.quantize,
    )  # fmt: skip
    assert engine.graphs is not None, "batch-1 decode here needs CUDA graphs"
    print(f"engine ready in {time.time() - started:.0f} s", flush=True)
    roofline = bandwidth / weight_bytes(engine)
    variants: list[dict[tuple[int, int], Tile]] = [{}, *args.variant]
    names = ["committed"] + [
        " ".join(f"{k}={','.join(map(str, v[s]))}" for k, s in SHAPES.items() if s in v)
        for v in args.variant
    ]
    for wanted, name in ((args.least_attention, LEAST_ATTENTION),
                         (args.without_attention, NO_ATTENTION)):  # fmt: skip
        if wanted:
            variants.append({})
            names.append(name)
    attention = {NO_ATTENTION: without_attention, LEAST_ATTENTION: least_attention}
    reference: list[int] | None = None
    rows: list[dict[str, Any]] = []
    print(f"{'variant':<40} {'round':>5} {'engine tok/s':>12} {'of roof':>8} {'graph alone':>11}")
    for r in range(args.rounds):
        order = list(range(len(variants)))
        for i in order if r % 2 == 0 else order[::-1]:
            with tiles_of(variants[i]), attention.get(names[i], nullcontext)():
                engine.graphs.use_row_kernels(True)  # captured with this variant's tiles
            tokens = greedy_tokens(engine)
            reference = reference or tokens
            rate = batch1_decode(engine, 512, args.steps)
            alone = graph_only(engine, 512, args.steps)
            same = tokens == reference
            print(
                f"{names[i]:<40} {r:>5} {rate:>12.1f} {rate / roofline:>8.1%} {alone:>11.1f}"
                f"{'' if same else '  (other greedy tokens)'}",
                flush=True,
            )
            rows.append(
                {
                    "variant": names[i],
                    "round": r,
                    "tok_s": rate,
                    "of_roofline": rate / roofline,
                    "graph_tok_s": alone,
                    "same_tokens": same,
                }
            )
    del engine
    free()
    write_json(
        args.json,
        {
            "device": torch.cuda.get_device_name(),
            "copy_bandwidth": bandwidth,
            "quantize": args.quantize,
            "roofline_tok_s": roofline,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
