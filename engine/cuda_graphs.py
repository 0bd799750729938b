"""Decode steps replayed as CUDA graphs, one per batch-size bucket, captured at start-up.

A decode-only step has shapes fixed by its batch size alone, once attention reads the KV pool
through block tables (the paged kernel) instead of gathering contexts of varying length. Each
bucket's graph reads static input rows: token, position, KV slot, context length, block table.
A step fills the first rows from one page-locked host buffer with one copy (padding rows point
at a reserved dummy block), replays, and reads the logits of its real rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.attention import AttentionMetadata, KernelDecode
from engine.batch import SeqInput
from engine.kernels.paged_decode import PagedDecode
from engine.kv_cache import KVCache
from engine.model import Transformer

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Columns of a static input row: token, position, slot, context length, then the block table.
_TOKEN, _POS, _SLOT, _CTX, _TABLE = 0, 1, 2, 3, 4


class DecodeGraphs:
    def __init__(
        self,
        model: Transformer,
        kv: KVCache,
        dummy_block: int,
        max_batch: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    ) -> None:
        config = model.config
        self.model, self.kv, self.dummy_block = model, kv, dummy_block
        self.block_size = kv.block_size
        self.max_blocks = -(-config.max_seq_len // self.block_size)
        self.buckets = sorted(b for b in buckets if b <= max_batch) or [1]
        width = _TABLE + self.max_blocks
        biggest = self.buckets[-1]
        device = kv.pool.device
        self.rows = torch.zeros((biggest, width), dtype=torch.int64, device=device)
        self.host = torch.zeros((biggest, width), dtype=torch.int64).pin_memory()
        self.host_np = self.host.numpy()
        self.kernel = PagedDecode(
            biggest,
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
            self.block_size,
            config.max_seq_len,
            device,
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._fill_padding(0, biggest)
        self.rows.copy_(self.host)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):  # largest first, so smaller ones reuse its memory
            self.graphs[size] = self._capture(size, pool)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _meta(self, size: int) -> AttentionMetadata:
        rows = self.rows[:size]
        decodes = KernelDecode(
            torch.arange(size, device=rows.device), rows[:, _TABLE:], rows[:, _CTX], self.kernel
        )
        return AttentionMetadata(slot_mapping=rows[:, _SLOT], prefills=[], decodes=decodes)

    def _forward(self, size: int) -> torch.Tensor:
        rows = self.rows[:size]
        hidden = self.model(rows[:, _TOKEN], rows[:, _POS], self._meta(size), self.kv)
        return self.model.logits(hidden)  # (size, vocab)

    @torch.inference_mode()
    def _capture(self, size: int, pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compile Triton kernels and settle allocations before capture
                self._forward(size)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._forward(size)
        return graph, logits

    def _fill_padding(self, start: int, end: int) -> None:
        # Padding rows decode a token of nobody into the reserved dummy block.
        pad = self.host_np[start:end]
        pad[:] = 0
        pad[:, _SLOT] = self.dummy_block * self.block_size
        pad[:, _CTX] = 1
        pad[:, _TABLE] = self.dummy_block

    @torch.inference_mode()
    def run(self, batch: list[SeqInput]) -> torch.Tensor:
        """Logits (len(batch), vocab) of a decode-only batch; the bucket must exist."""
        n = len(batch)
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"no CUDA graph holds a batch of {n}")
        host, bs = self.host_np, self.block_size
        for i, seq in enumerate(batch):
            pos = seq.start_pos
            table = seq.block_table
            host[i, _TOKEN] = seq.token_ids[0]
            host[i, _POS] = pos
            host[i, _SLOT] = table[pos // bs] * bs + pos % bs
            host[i, _CTX] = pos + 1
            host[i, _TABLE : _TABLE + len(table)] = np.asarray(table, dtype=np.int64)
        self._fill_padding(n, size)
        # One page-locked host → device copy of every input of the step.
        self.rows[:size].copy_(self.host[:size], non_blocking=True)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]
