"""The scheduler → worker contract, one step at a time: data only, no behaviour.

One plan is in flight at a time: `Scheduler.schedule()` returns a StepPlan, the worker runs it
as one forward pass, and `Scheduler.update(plan, result)` must see its StepResult before the
next `schedule()`. (Planning step N+1 while step N runs needs the worker to feed its own sampled
ids back into the next step, as vLLM's async scheduling does; that is not in this version.)

Block tables are sent whole for every sequence, every step, as immutable tuples the scheduler
rebuilds only when a sequence gains a block, so building a plan copies no tables. A transport
that wants vLLM v1's diff (new block ids only, for sequences the worker already knows) derives
it by remembering the previous table's length per request id; `finished_request_ids` tells it
when to forget one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ScheduledSeq:
    # Which request this row belongs to; the worker keys any per-sequence state by it.
    request_id: str
    # The new tokens to run: a prefill chunk, or the one token sampled by the previous step.
    token_ids: list[int]
    # Position of token_ids[0] in the sequence; positions before it are already in the KV cache.
    start_pos: int
    # Every physical KV block of the sequence, in order; token p lives in
    # block_table[p // block_size] at offset p % block_size.
    block_table: tuple[int, ...]
    # False for a prefill chunk that does not reach the end of the known tokens: the worker
    # computes its KV and skips sampling.
    sample: bool
    # The request's sampling parameters, passed through untouched.
    sampling: Any


@dataclass(slots=True)
class StepPlan:
    # Increases by one per plan; the result names it back, and traces use it as the step's id.
    step_id: int
    # The batch, in the scheduler's priority order.
    seqs: list[ScheduledSeq]
    # Requests the worker may forget since the last plan: finished, cancelled, failed or
    # preempted (a preempted request comes back later as if new, with a fresh block table).
    finished_request_ids: list[str] = field(default_factory=list)
    # Prompt (and resume) tokens in this step, and single-token decodes: the cost model inputs.
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(slots=True)
class StepResult:
    # The plan this answers.
    step_id: int
    # request_id -> (sampled token id, its logprob), for every sequence planned with sample=True.
    # A missing entry fails that request alone (the worker could not sample it).
    sampled: dict[str, tuple[int, float]]
