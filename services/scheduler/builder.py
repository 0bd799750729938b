"""The step being built, in the plan's columns (see protocol.py), by the passes of `schedule()`.

Rows come in two sections: single-token decodes first, then prefill chunks, each in the order
the passes add them (priority order). A decode row always has one token and always samples, so
its section keeps only its start and its token, in flat lists the hot loop appends to; request
ids and block tables are read off the requests in one go when the plan is made.
Decodes first is also the order attention kernels want (vLLM reorders its batch the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from services.protocol import PLACEHOLDER, StepPlan
from services.scheduler.request import RequestState

_seq_id = attrgetter("seq_id")
_block_table = attrgetter("block_table")


@dataclass(slots=True)
class StepBuilder:
    budget: int  # new tokens this step may still take
    # Prefill of priority below `yield_below` shares `lower_prefill_left` tokens in this
    # step (`lower_priority_prefill_tokens`); None: no such limit.
    yield_below: int | None = None
    lower_prefill_limit: int = 0
    chunked: bool = True
    lower_prefill_left: int = field(init=False)
    size: int = field(init=False)  # the step's whole budget
    # Decode rows: the request, the position of its one token, that token.
    decode_reqs: list[RequestState] = field(default_factory=list)
    decode_starts: list[int] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    # Prefill rows: the request, the chunk's start, its tokens (flat) and count, whether
    # the chunk reaches the end of the known tokens and samples.
    prefill_reqs: list[RequestState] = field(default_factory=list)
    prefill_starts: list[int] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    prefill_counts: list[int] = field(default_factory=list)
    prefill_samples: list[bool] = field(default_factory=list)
    # Sampling parameters of the requests admitted (or resumed) in this step.
    new_sampling: dict[int, Any] = field(default_factory=dict)
    # (priority, effective priority) of the most important prefill in the step so far.
    prefill_top: tuple[int, float] | None = None
    # The waiting head's priority when the step began, and how many decodes in the step
    # are of lower priority: a prefill at that priority is not charged for them, so its
    # step is about as long as on an idle worker (`isolate_priority_prefill`).
    floor_priority: int | None = None
    outranked_decodes: int = 0

    def __post_init__(self) -> None:
        self.lower_prefill_left = self.lower_prefill_limit
        self.size = self.budget

    @property
    def num_rows(self) -> int:
        return len(self.decode_reqs) + len(self.prefill_reqs)

    def holds_back(self, priority: int, rank: float) -> bool:
        """Whether a prefill of this priority must wait for a step of its own: a step carrying a
        more important prefill stays as short as that prefill. Aging lifts the hold (rank)."""
        top = self.prefill_top
        return top is not None and priority < top[0] and rank < top[1]

    def cap(self, req: RequestState, chunk: int, whole: bool = False) -> int:
        """`chunk` cut to what this step still allows req's priority (may be 0); `whole`: to
        what a step allows it at most."""
        if self.yield_below is None or req.priority >= self.yield_below:
            return chunk
        if whole:
            # An unsplittable prompt is not limited, only kept to one per step (below).
            return min(chunk, self.lower_prefill_limit) if self.chunked else chunk
        left = self.lower_prefill_left
        if self.chunked:
            return min(chunk, left)
        # A prompt that cannot be split goes whole, if it is the step's first: never starved.
        return chunk if chunk <= left or left == self.lower_prefill_limit else 0

    def next_chunk(self, req: RequestState, budget: int, threshold: int) -> int:
        """The next prefill chunk of a running request within `budget`; 0 if none fits."""
        left = len(req.token_ids) - req.num_computed_tokens
        limit = min(left, budget, threshold) if req.long_prefill else min(left, budget)
        chunk = self.cap(req, limit)
        return chunk if chunk > 0 and (self.chunked or chunk == left) else 0

    def add_prefill(self, req: RequestState, start: int, end: int) -> None:
        tokens = req.token_ids
        sample = end == len(tokens)
        self.prefill_reqs.append(req)
        self.prefill_starts.append(start)
        self.prefill_tokens.extend(tokens[start:end])
        self.prefill_counts.append(end - start)
        self.prefill_samples.append(sample)
        req.num_computed_tokens = end
        if sample:
            # The next row is a decode of the token this one samples.
            req.decoding = True
            req.last_token = PLACEHOLDER
        self.budget -= end - start
        if self.yield_below is not None and req.priority < self.yield_below:
            self.lower_prefill_left -= end - start
        if self.prefill_top is None or (req.priority, req.rank) > self.prefill_top:
            self.prefill_top = (req.priority, req.rank)

    def remove(self, req: RequestState) -> None:
        """Take req's row back out (if it has one), and its tokens back into the budget."""
        self.new_sampling.pop(req.seq_id, None)
        # Requests compare by identity (eq=False), and a request has at most one row.
        if req in self.decode_reqs:
            k = self.decode_reqs.index(req)
            del self.decode_reqs[k], self.decode_tokens[k]
            req.num_computed_tokens = self.decode_starts.pop(k)
            self.budget += 1
            if self.floor_priority is not None and req.priority < self.floor_priority:
                # Its token is back in the budget: it no longer earns the prefill an allowance.
                self.outranked_decodes = max(0, self.outranked_decodes - 1)
        elif req in self.prefill_reqs:
            k = self.prefill_reqs.index(req)
            offset = sum(self.prefill_counts[:k])
            n = self.prefill_counts.pop(k)
            del self.prefill_reqs[k], self.prefill_samples[k]
            del self.prefill_tokens[offset : offset + n]
            req.num_computed_tokens = self.prefill_starts.pop(k)
            self.budget += n
            if self.yield_below is not None and req.priority < self.yield_below:
                self.lower_prefill_left += n

    def plan(self, step_id: int, finished: list[int]) -> tuple[StepPlan, list[RequestState]]:
        """The plan, and the request behind each of its rows."""
        # The decode section's lists become the plan's: the prefill rows are appended to them.
        num_decodes = len(self.decode_reqs)
        reqs, tokens, starts = self.decode_reqs, self.decode_tokens, self.decode_starts
        num_tokens, sample = [1] * num_decodes, [True] * num_decodes
        if self.prefill_reqs:
            reqs += self.prefill_reqs
            tokens += self.prefill_tokens
            starts += self.prefill_starts
            num_tokens += self.prefill_counts
            sample += self.prefill_samples
        plan = StepPlan(
            step_id,
            list(map(_seq_id, reqs)),
            tokens,
            num_tokens,
            starts,
            list(map(_block_table, reqs)),
            sample,
            self.new_sampling,
            finished,
            len(self.prefill_tokens),
            num_decodes,
        )
        return plan, reqs
