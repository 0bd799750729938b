"""Greedy picks inside a decode step's CUDA graph (Triton): each row's most likely token and its
logprob, packed for the host.

Outside the graph, greedy sampling is an argmax, a logsumexp, a gather and the packing of the
results: some ten small kernels a step, each a few microseconds of an otherwise idle GPU at
batch 1. Here program (row, s) takes the s-th chunk of a row's logits, leaves its maximum, the
first token holding it and its sum of exp(logit - maximum) in a workspace, and bumps the row's
counter; the last chunk to arrive merges them. The logprob of the argmax is -log Σ exp(l - max).
Ties go to the lowest token id, as torch.argmax's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _greedy(
    logits_ptr, stride_row, vocab, max_ptr, arg_ptr, sum_ptr, counter_ptr, tokens_ptr, picks_ptr,
    CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    s = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ids = s * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_row + ids, mask=ids < vocab, other=float("-inf"))
    m = tl.max(x, 0)
    at = row * CHUNKS + s
    tl.store(max_ptr + at, m)
    tl.store(arg_ptr + at, tl.argmax(x, 0) + s * BLOCK)  # the first maximum of the chunk
    tl.store(sum_ptr + at, tl.sum(tl.exp(x - m), 0))
    counter = counter_ptr + row
    if tl.atomic_add(counter, 1, sem="acq_rel") == CHUNKS - 1:  # the last chunk: merge
        tl.atomic_xchg(counter, 0, sem="relaxed")  # as merge.py's: no ordering needed, issued early
        c = tl.arange(0, CHUNKS_PAD)
        every = row * CHUNKS + c
        cm = c < CHUNKS
        # Written by other programs: read past this one's L1.
        ms = tl.load(max_ptr + every, mask=cm, other=float("-inf"), cache_modifier=".cg")
        args = tl.load(arg_ptr + every, mask=cm, other=0, cache_modifier=".cg")
        sums = tl.load(sum_ptr + every, mask=cm, other=0.0, cache_modifier=".cg")
        top = tl.max(ms, 0)
        token = tl.min(tl.where(ms == top, args, vocab), 0)  # chunks hold ids in order
        # NaN logits match no maximum: still a token id (the next step embeds it).
        token = tl.minimum(token, vocab - 1)
        total = tl.sum(tl.where(cm, sums * tl.exp(ms - top), 0.0), 0)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(picks_ptr + 2 * row, token.to(tl.float64))
        tl.store(picks_ptr + 2 * row + 1, -tl.log(total).to(tl.float64))


class GreedyPicks:
    """Workspace for the picks of up to `rows` rows of `vocab` logits, reused step after step
    (and by CUDA graphs)."""

    def __init__(self, rows: int, vocab: int, device: torch.device, block: int = 4096) -> None:
        self.block = min(block, triton.next_power_of_2(vocab))
        self.chunks = -(-vocab // self.block)
        size = rows * self.chunks
        self.maxima = torch.empty(size, dtype=torch.float32, device=device)
        self.args = torch.empty(size, dtype=torch.int32, device=device)
        self.sums = torch.empty(size, dtype=torch.float32, device=device)
        self.counters = torch.zeros(rows, dtype=torch.int32, device=device)

    def __call__(
        self, logits: torch.Tensor, pdl: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: (R, vocab) fp32, rows contiguous. Returns each row's argmax (R,) int64, and
        (R, 2) float64 rows of (that token, its logprob)."""
        rows, vocab = logits.shape
        assert logits.stride(1) == 1 and rows <= self.counters.numel()
        tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
        picks = torch.empty((rows, 2), dtype=torch.float64, device=logits.device)
        _greedy[(rows, self.chunks)](
            logits, logits.stride(0), vocab, self.maxima, self.args, self.sums, self.counters,
            tokens, picks, CHUNKS=self.chunks, CHUNKS_PAD=triton.next_power_of_2(self.chunks),
            BLOCK=self.block, PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
        return tokens, picks
