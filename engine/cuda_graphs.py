"""Decode steps replayed as CUDA graphs, one per batch-size bucket, captured at start-up.

A decode-only step has shapes fixed by its batch size alone, once attention reads the KV pool
through block tables (the paged kernel) instead of gathering contexts of varying length. Each
bucket's graph reads static input rows: token, position, KV slot, context length, block table.
A step fills the first rows from a page-locked host buffer with one copy (padding rows point
at a reserved dummy block), replays, and reads the logits of its real rows. The batch-1 graph
runs engine/row_decode.py's fused kernels instead of the model's modules where it can. Every
graph ends with each row's greedy pick and its logprob (engine/kernels/greedy.py), so a step
whose rows all decode greedily samples nothing outside the graph.

A decode step can also be replayed ahead (`replay_next`): fed on the device the tokens just
sampled, it runs while the host hands the last step's tokens back and plans the next; if the
next step asked for is that one, its logits are ready or nearly so.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from engine.attention import AttentionMetadata, KernelDecode
from engine.batch import FROM_LAST_STEP, SeqInput
from engine.errors import InvalidRequest
from engine.graph_blas import products_for_rows
from engine.kernels.greedy import GreedyPicks
from engine.kernels.paged_decode import PagedDecode
from engine.kv_cache import KVCache
from engine.model import Transformer
from engine.row_decode import RowDecoder


class Fill(Protocol):
    @property
    def at(self) -> torch.Tensor: ...  # (F,) rows

    @property
    def tokens(self) -> torch.Tensor: ...  # (F,) their tokens


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
        vocab_size: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    ) -> None:
        """vocab_size: the logits' width (on a tensor-parallel rank, the whole vocabulary's;
        model.config is the rank's slice)."""
        config = model.config
        self.model, self.kv, self.dummy_block = model, kv, dummy_block
        self.block_size = kv.block_size
        self.max_blocks = -(-config.max_seq_len // self.block_size)
        self.buckets = sorted(b for b in buckets if b <= max_batch) or [1]
        width = _TABLE + self.max_blocks
        biggest = self.buckets[-1]
        device = kv.pool.device
        self.max_len = config.max_seq_len
        self.rows = torch.zeros((biggest, width), dtype=torch.int64, device=device)
        # Two page-locked input buffers, taken in turn: a step replayed ahead (replay_next) fills
        # one while the copy of the step before it, from the other, may not have run yet. A
        # buffer is written again only once its last copy has run (`_copied`).
        self.hosts = [torch.zeros((biggest, width), dtype=torch.int64).pin_memory() for _ in "ab"]
        # The block table each host buffer's row holds: a row is rewritten (and its block ids
        # checked) only when its table changed, which for a decoding sequence is once a block.
        self._tables: list[list[Sequence[int] | None]] = [[None] * biggest for _ in "ab"]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.kernel = PagedDecode(
            biggest,
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
            self.block_size,
            config.max_seq_len,
            device,
            kv_dtype=kv.pool.dtype,
        )
        # Many-row buckets: attention rotates and stores each row's new token itself (False, then
        # `recapture`: a RoPE + store kernel before it, which bench/new_token_fusion.py compares).
        self.fuse_new_tokens = True
        # The batch-1 bucket through fused kernels where the model's weights allow.
        self.row = RowDecoder.for_model(model, kv)
        self.greedy = GreedyPicks(biggest, vocab_size, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, GraphOutputs]] = {}
        for turn in range(2):
            self._fill_padding(turn, 0, biggest)
        self.rows.copy_(self.hosts[0])
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):  # largest first, so smaller ones reuse its memory
            self.graphs[size] = self._capture(size, pool)

    def use_row_kernels(self, on: bool) -> None:
        """Recapture the batch-1 graph with (where the weights allow) or without the fused row
        kernels; benchmarks compare the two."""
        self.row = RowDecoder.for_model(self.model, self.kv) if on else None
        if 1 in self.graphs:
            self.recapture(1)

    def recapture(self, size: int) -> None:
        """Capture bucket `size`'s graph again, after a setting benchmarks compare changed
        (`fuse_new_tokens`, the row kernels)."""
        self.graphs[size] = self._capture(size, torch.cuda.graph_pool_handle())

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _meta(self, size: int) -> AttentionMetadata:
        rows = self.rows[:size]
        decodes = KernelDecode(
            torch.arange(size, device=rows.device),
            rows[:, _TABLE:],
            rows[:, _CTX],
            self.kernel,
            # RoPE and the K/V store inside attention: a launch a layer fewer.
            new_tokens=self.kernel if self.fuse_new_tokens else None,
        )
        return AttentionMetadata(slot_mapping=rows[:, _SLOT], prefills=[], decodes=decodes)

    def _forward(self, size: int) -> GraphOutputs:
        rows = self.rows[:size]
        if size == 1 and self.row is not None:
            logits = self.row(rows[:, _TOKEN], rows[:, _SLOT], rows[:, _CTX], rows[:, _TABLE:])
            pdl = self.row.pdl
        else:
            hidden = self.model(rows[:, _TOKEN], rows[:, _POS], self._meta(size), self.kv)
            logits, pdl = self.model.logits(hidden), False  # (size, vocab) fp32
        return GraphOutputs(logits, *self.greedy(logits, pdl=pdl))

    @torch.inference_mode()
    def _capture(self, size: int, pool: Any) -> tuple[torch.cuda.CUDAGraph, GraphOutputs]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with products_for_rows(size, self.rows.device):
            with torch.cuda.stream(side):
                for _ in range(2):  # compile Triton kernels and settle allocations first
                    self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self._forward(size)
        return graph, outputs

    def _fill_padding(self, turn: int, start: int, end: int) -> None:
        # Padding rows decode a token of nobody into the reserved dummy block.
        pad = self.hosts[turn].numpy()[start:end]
        pad[:] = 0
        pad[:, _SLOT] = self.dummy_block * self.block_size
        pad[:, _CTX] = 1
        pad[:, _TABLE] = self.dummy_block
        self._tables[turn][start:end] = [None] * (end - start)

    def _load(
        self, batch: Sequence[SeqInput], tokens: np.ndarray, positions: np.ndarray
    ) -> tuple[int, GraphOutputs]:
        """Copy the inputs of `batch` (tokens and positions (n,)) into the static rows; returns
        the bucket and its outputs' rows, to be filled by replaying the bucket."""
        n = len(batch)
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"no CUDA graph holds a batch of {n}")
        turn = self._turn
        self._turn ^= 1
        last_copy = self._copied[turn]
        if last_copy is not None:
            last_copy.synchronize()  # long done in practice: a whole step has passed since
        buffer, tables = self.hosts[turn], self._tables[turn]
        host, bs = buffer.numpy(), self.block_size
        for i, seq in enumerate(batch):
            table = seq.block_table
            held = tables[i]
            if held is not table and held != table:
                if min(table) < 0 or max(table) >= self.dummy_block:
                    raise InvalidRequest(
                        "block_table", f"sequence {seq.seq_id} names blocks outside the pool"
                    )
                host[i, _TABLE : _TABLE + len(table)] = table
                tables[i] = table
        rows = host[:n]
        rows[:, _TOKEN] = tokens
        rows[:, _POS] = positions
        rows[:, _CTX] = positions + 1
        block_of = rows[np.arange(n), _TABLE + positions // bs]
        rows[:, _SLOT] = block_of * bs + positions % bs
        self._fill_padding(turn, n, size)
        # One page-locked host → device copy of every input of the step.
        self.rows[:size].copy_(buffer[:size], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._copied[turn] = copied
        return size, self.graphs[size][1].head(n)

    @torch.inference_mode()
    def run(
        self,
        batch: Sequence[SeqInput],
        tokens: np.ndarray,
        positions: np.ndarray,
        fill: Fill | None = None,
    ) -> GraphOutputs:
        """The outputs of a decode-only batch (its tokens and positions (n,)), n rows; the
        bucket must exist. `fill`: tokens put in place on the device (FROM_LAST_STEP)."""
        size, outputs = self._load(batch, tokens, positions)
        if fill is not None:
            self.rows[:, _TOKEN].index_copy_(0, fill.at, fill.tokens)
        self.graphs[size][0].replay()
        return outputs

    @torch.inference_mode()
    def replay_next(self, batch: Sequence[SeqInput], tokens: torch.Tensor) -> StepAhead | None:
        """Replay, before anyone asks for it, the step after `batch`: each sequence one position
        on, fed its sampled token (`tokens`, on the device). None where a sequence's next
        position falls in a block its table does not hold yet, or past the model's length.

        Its K/V land in a block of the sequence's own table (the scheduler hands out the next
        block a step early where it can), at a position nothing reads before a real step
        writes it: a step never asked for leaves no trace."""
        bs = self.block_size
        positions = [seq.start_pos + 1 for seq in batch]
        for seq, pos in zip(batch, positions, strict=True):
            if pos // bs >= len(seq.block_table) or pos >= self.max_len:
                return None
        n = len(batch)
        # The tokens' column is overwritten on the device below.
        size, outputs = self._load(batch, np.zeros(n, np.int64), np.array(positions, np.int64))
        self.rows[:n, _TOKEN].copy_(tokens)
        self.graphs[size][0].replay()
        return StepAhead(
            [seq.seq_id for seq in batch], positions, [list(s.block_table) for s in batch], outputs
        )


@dataclass(frozen=True)
class GraphOutputs:
    """What a replay leaves on the device, a row per sequence (static buffers: the next replay
    of the bucket overwrites them)."""

    logits: torch.Tensor  # (n, vocab) fp32
    tokens: torch.Tensor  # (n,) int64: each row's most likely token
    picks: torch.Tensor  # (n, 2) float64: that token and its logprob, in SampledBatch.packed's form

    def head(self, n: int) -> GraphOutputs:
        return GraphOutputs(self.logits[:n], self.tokens[:n], self.picks[:n])


@dataclass
class StepAhead:
    """A decode step replayed ahead of its request (DecodeGraphs.replay_next)."""

    seq_ids: list[Hashable]
    positions: list[int]
    tables: list[list[int]]
    outputs: GraphOutputs  # being computed
    tokens: list[int] = field(default_factory=list)  # what the step before sampled, once known

    def matches(self, batch: Sequence[SeqInput]) -> bool:
        """`batch` is the very step replayed: same sequences, positions, tokens and blocks (a
        table may have gained blocks past the ones replayed: the scheduler hands out the next
        block a step early, and a step reads and writes no block past its position's)."""
        n = len(self.seq_ids)
        tokens = self.tokens or [FROM_LAST_STEP] * n  # not collected yet: known on the device only
        return (
            len(batch) == n
            and len(tokens) == n
            and all(
                seq.seq_id == seq_id
                and seq.start_pos == pos
                and len(seq.token_ids) == 1
                # FROM_LAST_STEP: what the step before sampled, which is what the replay took.
                and seq.token_ids[0] in (token, FROM_LAST_STEP)
                and list(seq.block_table[: len(table)]) == table
                for seq, seq_id, pos, token, table in zip(
                    batch, self.seq_ids, self.positions, tokens, self.tables, strict=True
                )
            )
        )
