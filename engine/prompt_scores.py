"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob and rank given
the tokens before it, from the hidden states of the prefill chunks that hold it.

The token at position t is scored by the row at t - 1. A chunk's own rows score every token of
it but its first; the first is scored by the last row of the chunk before, which is kept here
(one hidden row per sequence in the middle of its prompt) until that chunk comes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from engine import cpu_kernels
from engine.batch import SeqInput
from engine.upload import to_device

# Logits are made for this many rows at a time: a whole 2,048-token chunk's would be a
# (2048, vocab) fp32 block, a gigabyte for LLaMA-3's vocabulary.
ROWS_AT_ONCE = 256


@dataclass
class PromptLogprobs:
    """The scored prompt tokens of one chunk: positions start, start + 1, ..."""

    seq_id: Hashable
    start: int
    logprobs: list[float]
    ranks: list[int]  # 1: the model's most likely token at that position
    top: list[list[tuple[int, float]]]  # prompt_logprobs alternatives a token, best first


@dataclass
class PendingScores:
    """A chunk's scores on the device, read on the host once the step is done."""

    seq_id: Hashable
    start: int
    logprobs: torch.Tensor  # (N,) float32
    ranks: torch.Tensor  # (N,) int64
    top_ids: torch.Tensor  # (N, n) int64
    top_logprobs: torch.Tensor  # (N, n) float32

    def to_host(self) -> PromptLogprobs:
        ids, lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        return PromptLogprobs(
            self.seq_id,
            self.start,
            self.logprobs.tolist(),
            self.ranks.tolist(),
            [list(zip(i, lp, strict=True)) for i, lp in zip(ids, lps, strict=True)],
        )


def scores_prompt(seq: SeqInput) -> bool:
    """Whether this row is a prefill chunk whose prompt tokens are to be scored."""
    return seq.sampling.prompt_logprobs is not None and seq.start_pos < seq.prompt_len


class PromptScorer:
    def __init__(self, logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """logits: (N, dim) final hidden states → (N, vocab) fp32 (the model's head)."""
        self._logits = logits
        # seq id → (position, hidden row) of the last row of a chunk that ended inside the prompt.
        self._held: dict[Hashable, tuple[int, torch.Tensor]] = {}

    def score(self, batch: Sequence[SeqInput], hidden: torch.Tensor) -> list[PendingScores]:
        """hidden: the step's (T, dim) final hidden states, the rows of `batch` in order. The
        rows of every scored sequence go through the head together: it is read once a step (on a
        CPU, reading a large vocabulary's head costs more than its arithmetic)."""
        scored: list[tuple[SeqInput, int]] = []  # (sequence, the position it scores first)
        rows: list[torch.Tensor] = []
        targets: list[int] = []
        offset = 0
        for seq in batch:
            n = len(seq.token_ids)
            if scores_prompt(seq):
                first = self._rows(seq, hidden[offset : offset + n], rows, targets)
                if first is not None:
                    scored.append((seq, first))
            offset += n
        if not scored:
            return []
        before = torch.cat(rows)
        wanted = to_device(targets, hidden.device)
        top_n = max(seq.sampling.prompt_logprobs or 0 for seq, _ in scored)
        parts = [
            self._chunk(before[a : a + ROWS_AT_ONCE], wanted[a : a + ROWS_AT_ONCE], top_n)
            for a in range(0, len(targets), ROWS_AT_ONCE)
        ]
        lp, ranks, top_ids, top_lp = (torch.cat(column) for column in zip(*parts, strict=True))
        out = []
        a = 0
        for seq, first in scored:
            b = a + min(seq.start_pos + len(seq.token_ids), seq.prompt_len) - first
            n = seq.sampling.prompt_logprobs or 0
            out.append(
                PendingScores(
                    seq.seq_id, first, lp[a:b], ranks[a:b], top_ids[a:b, :n], top_lp[a:b, :n]
                )
            )
            a = b
        return out

    def release(self, seq_id: Hashable) -> None:
        self._held.pop(seq_id, None)

    def _rows(
        self, seq: SeqInput, chunk: torch.Tensor, rows: list[torch.Tensor], targets: list[int]
    ) -> int | None:
        """Add the rows that score this chunk's prompt tokens, and those tokens, to `rows` and
        `targets`; the position of the first (None: nothing to score)."""
        start, n, prompt_len = seq.start_pos, len(seq.token_ids), seq.prompt_len
        held = self._held.pop(seq.seq_id, None)
        if start + n < prompt_len:  # the next chunk's first token is scored by this last row
            self._held[seq.seq_id] = (start + n - 1, chunk[n - 1].clone())
        # Tokens at positions first..end-1 are scored: the first has nothing before it, and
        # positions from prompt_len on are output tokens (a resumed sequence re-prefills them).
        first, end = max(start, 1), min(start + n, prompt_len)
        if first == start and (held is None or held[0] != start - 1):
            first += 1  # the row before this chunk is not known here (it was never computed)
        if first >= end:
            return None
        if first == start:  # the held row, then this chunk's rows
            assert held is not None
            rows.append(held[1][None])
            rows.append(chunk[: end - 1 - start])
        else:
            rows.append(chunk[first - 1 - start : end - 1 - start])
        targets.extend(seq.token_ids[first - start : end - start])
        return first

    def _chunk(
        self, hidden: torch.Tensor, targets: torch.Tensor, top_n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self._logits(hidden)  # (R, V) fp32
        if logits.device.type == "cpu" and cpu_kernels.usable(logits):
            return torch.ops.tandem.score_rows(logits.contiguous(), targets, top_n)
        return score_rows(logits, targets, top_n)


def score_rows(
    logits: torch.Tensor, targets: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's target logprob, its rank, and the top n ids and logprobs, in PyTorch (the
    native CPU kernel's reference)."""
    norm = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(1, targets[:, None])  # (R, 1)
    ranks = (logits > chosen).sum(dim=-1) + 1
    values, ids = logits.topk(top_n, dim=-1)  # top_n 0: empty (R, 0)
    return chosen[:, 0] - norm, ranks, ids, values - norm[:, None]
