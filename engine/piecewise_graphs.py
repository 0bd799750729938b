"""Steps that carry prompts, replayed as CUDA graphs in pieces around attention.

A step with prompts mixes rows whose attention differs (whole prompts, chunks, decodes), so it
cannot be one graph. Launched eagerly, a small one costs the host more than the GPU: ~10 kernels
a layer at tens of microseconds of Python each (bench/RESULTS-gpu.md). Everything but attention
depends on the step's token count alone, so for each of a set of token counts (buckets) the work
from one layer's attention output to the next layer's stored K/V is captured as one graph, a
piece: n_layers + 1 pieces a bucket, over static buffers that every bucket shares. A step pads
its rows to the bucket, replays piece 0 (embedding to layer 0's K/V), then for each layer runs
attention eagerly over its real rows and replays the next piece. Padding rows compute values no
real row reads (every operation but attention works row by row) and store their K/V in the
reserved dummy block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.graph_blas import products_for_rows
from engine.kv_cache import KVCache
from engine.model import Transformer

# Token counts up to which a step is host-bound when launched eagerly (one short prompt with up
# to 256 decodes); past them the GPU's work hides the launches.
DEFAULT_BUCKETS = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class PiecewiseGraphs:
    def __init__(
        self,
        model: Transformer,
        kv: KVCache,
        dummy_block: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        capture: bool = True,
    ) -> None:
        """capture False runs the pieces eagerly instead of replaying graphs of them (on the
        CPU, where tests check the pieces against the model's forward)."""
        config = model.config
        self.model, self.kv = model, kv
        self.buckets = sorted(buckets)
        biggest, device = self.buckets[-1], kv.pool.device
        dtype = model.norm.weight.dtype
        width = config.n_heads + 2 * config.n_kv_heads
        self.dummy_slot = dummy_block * kv.block_size
        self.tokens = torch.zeros(biggest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(biggest, dtype=torch.int64, device=device)
        self.slots = torch.full((biggest,), self.dummy_slot, dtype=torch.int64, device=device)
        self.cos = torch.zeros(biggest, config.head_dim, dtype=dtype, device=device)
        self.sin = torch.zeros_like(self.cos)
        self.qkv = torch.zeros(biggest, width, config.head_dim, dtype=dtype, device=device)
        self.heads = torch.zeros(
            biggest, config.n_heads, config.head_dim, dtype=dtype, device=device
        )
        self.residual = torch.zeros(biggest, config.dim, dtype=dtype, device=device)
        self.hidden = torch.zeros_like(self.residual)
        self.pieces: dict[int, list[Callable[[], Any]]] = {}
        pool = torch.cuda.graph_pool_handle() if capture else None
        for size in reversed(self.buckets):  # largest first, so smaller ones reuse its memory
            pieces: list[Callable[[], Any]] = [
                functools.partial(self._piece, size, i) for i in range(config.n_layers + 1)
            ]
            if not capture:
                self.pieces[size] = pieces
                continue
            with products_for_rows(size, device):
                self.pieces[size] = [self._capture(p, pool) for p in pieces]

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _piece(self, size: int, i: int) -> None:
        """Piece i of a step of `size` rows: 0 from the tokens to layer 0's stored K/V; then from
        layer i - 1's attention output to layer i's stored K/V; the last to the final norm."""
        blocks = self.model.blocks()
        if i == 0:
            x = self.model.tok_embeddings(self.tokens[:size])
            cos, sin = self.model.rope_tables(self.positions[:size], x.dtype)
            self.cos[:size].copy_(cos)
            self.sin[:size].copy_(sin)
            residual = None
        else:
            x, residual = blocks[i - 1].finish(self.heads[:size], self.residual[:size])
        if i == len(blocks):
            self.hidden[:size].copy_(self.model.norm(x, residual)[0])
            return
        qkv, residual = blocks[i].begin(
            x, residual, self.cos[:size], self.sin[:size], self.kv.layer(i), self.slots[:size]
        )
        self.qkv[:size].copy_(qkv)
        self.residual[:size].copy_(residual)

    @torch.inference_mode()
    def _capture(self, piece: Callable[[], None], pool: Any) -> Callable[[], None]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            piece()  # compile Triton kernels and settle allocations before capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            piece()
        return graph.replay

    @torch.inference_mode()
    def run(
        self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The final-normed hidden states (T, dim) of a step's T tokens (a bucket must hold T),
        as the model's forward gives them."""
        n = len(tokens)
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"no piecewise graph holds a step of {n} tokens")
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size].fill_(self.dummy_slot)  # rows a longer step left: padding again
        pieces = self.pieces[size]
        pieces[0]()
        for i, block in enumerate(self.model.blocks()):
            block.attention.attend(self.qkv[:n], self.kv.layer(i), meta, self.heads[:n])
            pieces[i + 1]()
        return self.hidden[:n].clone()  # the next step overwrites the static buffer
