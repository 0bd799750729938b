"""A step on its way and the tokens it sampled: `Submitted`, what `Engine.collect` waits on; the
step submitted last, whose tokens on the device the next step's FROM_LAST_STEP rows take
(`LastStep`); and where those tokens go among the next step's new tokens (`Fill`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.batch import FROM_LAST_STEP, SeqInput
from engine.errors import InvalidRequest
from engine.prompt_scores import PendingScores
from engine.upload import to_device

if TYPE_CHECKING:  # imports Triton: only on CUDA
    from engine.cuda_graphs import StepAhead


@dataclass
class Submitted:
    """A step on its way (Engine.submit): its sampling rows, and where their values arrive."""

    seqs: list[SeqInput]  # the rows that sample, in order
    packed: torch.Tensor  # SampledBatch.packed's rows, on the host (on CUDA: once `done`)
    n_top: int
    done: torch.cuda.Event | None = None  # recorded after the copy to the host; None on CPU
    ahead: StepAhead | None = None  # the step after it, replayed ahead; told its tokens
    # Its prefill rows' prompt logprobs (SamplingParams.prompt_logprobs); read after collect.
    prompt_scores: list[PendingScores] = dataclasses.field(default_factory=list)


@dataclass
class LastStep:
    """The sampled tokens of the step submitted last (on the device), by sequence."""

    rows: dict[Hashable, int]
    tokens: torch.Tensor  # (S,) int64
    submitted: Submitted

    def resolved(self, batch: Sequence[SeqInput]) -> list[SeqInput]:
        """`batch` with every FROM_LAST_STEP replaced by its token, read on the host."""
        if self.submitted.done is not None:
            self.submitted.done.synchronize()
        tokens = self.submitted.packed[:, 0].tolist()
        out = []
        for seq in batch:
            if FROM_LAST_STEP in seq.token_ids:
                ids = [_token(tokens, self.rows, seq, t) for t in seq.token_ids]
                seq = dataclasses.replace(seq, token_ids=ids)
            out.append(seq)
        return out


def _token(tokens: list[float], rows: dict[Hashable, int], seq: SeqInput, token: int) -> int:
    if token != FROM_LAST_STEP:
        return token
    if seq.seq_id not in rows:
        raise InvalidRequest("token_ids", _NOT_SAMPLED.format(seq.seq_id))
    return int(tokens[rows[seq.seq_id]])


_NOT_SAMPLED = "sequence {} takes FROM_LAST_STEP, but the step before sampled nothing for it"


class Fill:
    """Where a step's FROM_LAST_STEP tokens go among its new tokens (`at`), and those tokens;
    both on the device, made when first asked for (a step replayed ahead needs neither)."""

    def __init__(
        self, at: list[int], rows: list[int], last: LastStep, device: torch.device
    ) -> None:
        self._at, self._rows, self._last, self._device = at, rows, last, device

    @functools.cached_property
    def at(self) -> torch.Tensor:  # (F,) int64
        return to_device(self._at, self._device)

    @functools.cached_property
    def tokens(self) -> torch.Tensor:  # (F,) int64
        return self._last.tokens.index_select(0, to_device(self._rows, self._device))

    @staticmethod
    def of(batch: Sequence[SeqInput], last: LastStep | None, device: torch.device) -> Fill | None:
        at: list[int] = []
        rows: list[int] = []
        offset = 0
        for seq in batch:
            ids = seq.token_ids
            if FROM_LAST_STEP in ids:
                row = None if last is None else last.rows.get(seq.seq_id)
                if row is None:
                    raise InvalidRequest("token_ids", _NOT_SAMPLED.format(seq.seq_id))
                for j, token in enumerate(ids):
                    if token == FROM_LAST_STEP:
                        at.append(offset + j)
                        rows.append(row)
            offset += len(ids)
        return None if last is None or not at else Fill(at, rows, last, device)
