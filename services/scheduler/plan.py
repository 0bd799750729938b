"""The scheduler → worker contract, one step at a time: data only, no behaviour.

A plan is columnar, as vLLM v1's `CachedRequestData` is: one list per field, one entry per row
(a row is one sequence's work in the step), all lists the same length and in the same order.
Building a step then costs a few list appends per sequence instead of an object per sequence;
`StepPlan.seqs` gives the rows as objects for code that is not on the hot path.

Plans in flight. `Scheduler.schedule()` returns a plan, the worker runs it as one forward pass,
and `Scheduler.update(plan, result)` applies its result; results are applied in plan order.
Without `async_scheduling` one plan is in flight at a time. With it, the next plan may be built
while the previous one runs (at most two in flight), so the hop and the scheduler's own time
hide behind the step: a sequence that samples in plan N has, in plan N+1, a decode row whose one
token is `PLACEHOLDER`, the token the worker itself sampled for it in plan N. The worker must run
plans strictly in step order: a row of plan N+1 may belong to a request that update(N) has since
finished (its result is then dropped), and the blocks that request held may already be given to
another one by plan N+2; running the plans in order is what makes that safe.

Block tables are sent whole for every row, as immutable tuples the scheduler rebuilds only when a
sequence gains a block, so building a plan copies no tables. A transport that wants vLLM v1's
diff (new block ids only, for sequences the worker already knows) derives it by remembering the
previous table's length per request id; `finished_request_ids` tells it when to forget one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The token a row carries when the scheduler does not know it yet (async scheduling). The worker
# replaces it with the token it sampled for the same request in the plan just before this one
# (step_id - 1): on the device, without a host sync, as vLLM's async scheduling does. It is only
# ever the single token of a decode row, and the previous plan always has a row for that request
# that samples (if the worker failed that row, the request fails with it and this row's result is
# dropped, so any token will do).
PLACEHOLDER = -1


@dataclass(slots=True)
class ScheduledSeq:
    """One row of a plan as an object (see `StepPlan` for what each field means)."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool


@dataclass(slots=True)
class StepPlan:
    # Increases by one per non-empty plan; the result names it back, and traces use it as the
    # step's id. Plans in flight are consecutive: a PLACEHOLDER refers to step_id - 1.
    step_id: int
    # Which request each row belongs to; the worker keys any per-sequence state by it. A request
    # has at most one row per plan. The first num_decode_tokens rows are single-token decodes,
    # the rest prefill chunks; each section is in the scheduler's priority order.
    request_ids: list[str] = field(default_factory=list)
    # The new tokens of every row, concatenated in row order: num_tokens[i] of them for row i.
    # A row's tokens are a prefill chunk, or the one token of a decode (the token sampled by
    # an earlier step, or PLACEHOLDER for the one the previous plan samples).
    token_ids: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    # Position of each row's first new token; positions before it are in the KV cache (or are
    # written by an earlier plan, which the worker runs first).
    start_pos: list[int] = field(default_factory=list)
    # Every physical KV block of the row's sequence, in order; token p lives in
    # block_table[p // block_size] at offset p % block_size.
    block_tables: list[tuple[int, ...]] = field(default_factory=list)
    # False for a prefill chunk that does not reach the end of the known tokens: the worker
    # computes its KV and skips sampling.
    sample: list[bool] = field(default_factory=list)
    # request_id -> sampling parameters (passed through untouched), for each request whose
    # first row since it was admitted or resumed is in this plan: the worker keeps them for the
    # request's later rows, so they are not sent again (vLLM v1 sends its NewRequestData once).
    new_sampling: dict[str, Any] = field(default_factory=dict)
    # Requests the worker may forget since the last plan: finished, cancelled, failed or
    # preempted (a preempted request comes back later as if new, with a fresh block table). A
    # request forgotten here may still have a row in a plan sent before this one.
    finished_request_ids: list[str] = field(default_factory=list)
    # Prompt (and resume) tokens in this step, and single-token decodes (= decode rows): the
    # cost model's inputs.
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def is_empty(self) -> bool:
        return not self.request_ids

    def row_tokens(self) -> list[list[int]]:
        """token_ids split per row."""
        out, offset, flat = [], 0, self.token_ids
        for n in self.num_tokens:
            out.append(flat[offset : offset + n])
            offset += n
        return out

    @property
    def seqs(self) -> list[ScheduledSeq]:
        """The rows as objects, built on each call: for tests and code off the hot path."""
        return [
            ScheduledSeq(*row)
            for row in zip(
                self.request_ids,
                self.row_tokens(),
                self.start_pos,
                self.block_tables,
                self.sample,
                strict=True,
            )
        ]


@dataclass(slots=True)
class StepResult:
    # The plan this answers.
    step_id: int
    # request_id -> (sampled token id, its logprob), for every row planned with sample=True.
    # A missing entry fails that request alone (the worker could not sample it).
    sampled: dict[str, tuple[int, float]]
