"""The scheduler → worker step protocol: the plan, its placeholder token, and its wire records.

A sequence is named by one integer from its admission on: the `seq_id` the scheduler assigns
when it accepts a request. Plans, results, the step records on the wire, the worker's state and
the engine's batch all use it; only the scheduler's edge maps it to the client's request id.

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

On the wire (`encode_plan`), the prompt of a request is never copied: a prefill chunk inside the
prompt travels as a count (`from_prompt`) that the worker reads from the tokenizer's arena
through the request's handle, sent once with the sequence's first row. Only tokens beyond the
prompt (decodes, re-prefills after preemption) travel inline. Block tables travel whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from engine.sampling_params import SamplingParams
from tandem.internal.v1 import hotpath_pb2 as hp

# The one token of a decode row the scheduler does not know yet (async scheduling): the worker
# puts in the token it sampled for that sequence in plan step_id - 1, on the host as it builds
# the step's inputs. That plan always has a sampling row for it (if the worker failed that row,
# the sequence fails with it and this row's result is dropped).
PLACEHOLDER = -1


@dataclass(slots=True)
class ScheduledSeq:
    """One row of a plan as an object (see `StepPlan` for what each field means)."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool


@dataclass(slots=True)
class StepPlan:
    # Increases by one per non-empty plan; the result names it back, and traces use it as the
    # step's id. Plans in flight are consecutive: a PLACEHOLDER refers to step_id - 1.
    step_id: int
    # Which sequence each row belongs to. A sequence has at most one row per plan. The first
    # num_decode_tokens rows are single-token decodes, the rest prefill chunks; each section is
    # in the scheduler's priority order.
    seq_ids: list[int] = field(default_factory=list)
    # The new tokens of every row, concatenated in row order: num_tokens[i] of them for row i.
    # A row's tokens are a prefill chunk, or the one token of a decode (the token sampled by
    # an earlier step, or PLACEHOLDER for the one the previous plan samples).
    token_ids: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    # Position of each row's first new token; positions before it are in the KV cache (or are
    # written by an earlier plan, which the worker runs first).
    start_pos: list[int] = field(default_factory=list)
    # Every physical KV block of the row's sequence, in order; token p lives in
    # block_table[p // block_size] at offset p % block_size. Immutable tuples the scheduler
    # rebuilds only when a sequence gains a block, so building a plan copies no tables.
    block_tables: list[tuple[int, ...]] = field(default_factory=list)
    # False for a prefill chunk that does not reach the end of the known tokens: the worker
    # computes its KV and skips sampling.
    sample: list[bool] = field(default_factory=list)
    # seq_id -> sampling parameters (passed through untouched), for each sequence whose first
    # row since it was admitted or resumed is in this plan: the worker is told about it now,
    # once (vLLM v1 sends its NewRequestData once).
    new_sampling: dict[int, Any] = field(default_factory=dict)
    # Sequences the worker may forget since the last plan: finished, cancelled, failed or
    # preempted (a preempted sequence comes back later as if new, with a fresh block table). A
    # sequence forgotten here may still have a row in a plan sent before this one.
    finished_seq_ids: list[int] = field(default_factory=list)
    # Prompt (and resume) tokens in this step, and single-token decodes (= decode rows): the
    # cost model's inputs.
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def is_empty(self) -> bool:
        return not self.seq_ids

    def row_tokens(self) -> list[list[int]]:
        """token_ids split per row."""
        ends = accumulate(self.num_tokens)
        return [self.token_ids[end - n : end] for n, end in zip(self.num_tokens, ends, strict=True)]

    @property
    def seqs(self) -> list[ScheduledSeq]:
        """The rows as objects, built on each call: for tests and code off the hot path."""
        return [
            ScheduledSeq(*row)
            for row in zip(
                self.seq_ids,
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
    # seq_id -> (sampled token id, its logprob), for every row planned with sample=True. A
    # missing entry fails that sequence alone (the worker could not sample it).
    sampled: dict[int, tuple[int, float]]
    # seq_id -> why, for the sequences the worker could not run in this step (bad input).
    failed: dict[int, str] = field(default_factory=dict)


@dataclass
class SequenceRecord:
    """What the worker is told about a sequence with its first row (and again on a resume)."""

    seq_id: int
    prompt_len: int
    prompt_handle: bytes  # shm.Handle.to_bytes() of the prompt in the tokenizer's arena
    prompt_ids: list[int]  # or the prompt itself, without shared memory
    traceparent: str = ""
    # Generated so far: a resumed sequence's penalties need them.
    output_ids: list[int] = field(default_factory=list)


def encode_plan(plan: StepPlan, records: Mapping[int, SequenceRecord]) -> hp.StepDescriptor:
    desc = hp.StepDescriptor(
        step_id=plan.step_id,
        finished_seq_ids=plan.finished_seq_ids,
        seq_ids=plan.seq_ids,
        start_pos=plan.start_pos,
        num_tokens=plan.num_tokens,
        sample=plan.sample,
        num_prefill_tokens=plan.num_prefill_tokens,
        num_decode_tokens=plan.num_decode_tokens,
    )
    for seq_id, sampling in plan.new_sampling.items():
        r = records[seq_id]
        desc.new_seqs.add(
            seq_id=seq_id,
            prompt_handle=r.prompt_handle,
            prompt_ids=r.prompt_ids,
            prompt_len=r.prompt_len,
            sampling=sampling,
            traceparent=r.traceparent,
            output_ids=r.output_ids,
        )
    from_prompt: list[int] = []
    inline: list[int] = []
    block_counts: list[int] = []
    blocks: list[int] = []
    offset = 0
    for seq_id, start, n, table in zip(
        plan.seq_ids, plan.start_pos, plan.num_tokens, plan.block_tables, strict=True
    ):
        in_prompt = max(0, min(records[seq_id].prompt_len - start, n))
        from_prompt.append(in_prompt)
        inline += plan.token_ids[offset + in_prompt : offset + n]
        offset += n
        block_counts.append(len(table))
        blocks += table
    desc.from_prompt.extend(from_prompt)
    desc.inline_tokens.extend(inline)
    desc.block_counts.extend(block_counts)
    desc.blocks.extend(blocks)
    return desc


# Alternatives per sampled sequence, kept beside the scheduler core (which needs the token only).
TopLogprobs = dict[int, list[tuple[int, float]]]


def decode_outcome(outcome: hp.StepOutcome) -> tuple[StepResult, TopLogprobs]:
    sampled: dict[int, tuple[int, float]] = {}
    top: TopLogprobs = {}
    n = outcome.top_n
    rows = len(outcome.seq_ids)
    if (
        len(outcome.token_ids) != rows
        or len(outcome.logprobs) != rows
        or n < 0
        or len(outcome.top_ids) != n * rows
        or len(outcome.top_logprobs) != n * rows
    ):
        raise ValueError(f"an outcome whose columns disagree ({rows} rows, top_n {n})")
    for i, seq_id in enumerate(outcome.seq_ids):
        sampled[seq_id] = (outcome.token_ids[i], outcome.logprobs[i])
        if n:
            ids = outcome.top_ids[i * n : (i + 1) * n]
            lps = outcome.top_logprobs[i * n : (i + 1) * n]
            top[seq_id] = [(t, lp) for t, lp in zip(ids, lps, strict=True) if t >= 0]
    failed = dict(zip(outcome.failed_seq_ids, outcome.failed_reasons, strict=False))
    return StepResult(step_id=outcome.step_id, sampled=sampled, failed=failed), top


# The sampling fields that cross as they are (not seed, logit_bias or stop_token_ids).
_SCALARS = set(hp.Sampling.DESCRIPTOR.fields_by_name) - {
    "seed",
    "logit_bias",
    "stop_token_ids",
    "prompt_logprobs",
    "allowed_token_ids",
    "bad_words",
}


def sampling_to_pb(params: SamplingParams) -> hp.Sampling:
    msg = hp.Sampling(
        **{name: getattr(params, name) for name in _SCALARS},
        logit_bias=dict(params.logit_bias),
        stop_token_ids=params.stop_token_ids if params.min_tokens else (),
        allowed_token_ids=params.allowed_token_ids,
        bad_words=[hp.BadWord(ids=word) for word in params.bad_words_ids],
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    return msg


def sampling_from_pb(msg: hp.Sampling) -> SamplingParams:
    scalars = {name: getattr(msg, name) for name in _SCALARS}
    # float32 on the wire: round to what a float32 holds, so 0.9 stays within top_p's (0, 1].
    scalars["top_p"] = min(msg.top_p, 1.0)
    return SamplingParams(
        **scalars,
        seed=msg.seed if msg.HasField("seed") else None,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        stop_token_ids=tuple(msg.stop_token_ids),
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        allowed_token_ids=tuple(msg.allowed_token_ids),
        bad_words_ids=tuple(tuple(word.ids) for word in msg.bad_words),
    )
