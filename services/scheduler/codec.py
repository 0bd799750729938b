"""The scheduler core's plans and results ↔ the hot-path records the worker reads and writes.

The prompt of a request is never copied here: a prefill chunk inside the prompt travels as a
count (`from_prompt`) that the worker reads from the tokenizer's arena through the request's
handle. Only tokens beyond the prompt (decodes, and re-prefills after preemption) travel inline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.plan import StepPlan, StepResult
from tandem.internal.v1 import hotpath_pb2 as hp


@dataclass
class RequestRecord:
    """What the service keeps per request beside the core's own state."""

    request_id: str
    seq_id: int
    tokenizer_id: str
    prompt_len: int
    prompt_handle: bytes
    prompt_ids: list[int]  # only when the prompt came inline (no shared memory)
    sampling: hp.Sampling
    traceparent: str = ""
    output_ids: list[int] = field(default_factory=list)
    known_to_worker: bool = False


def encode_plan(
    plan: StepPlan, records: dict[str, RequestRecord], finishing: list[RequestRecord]
) -> hp.StepDescriptor:
    desc = hp.StepDescriptor(step_id=plan.step_id)
    forget = set(plan.finished_request_ids)
    for record in [*(records.get(r) for r in forget), *finishing]:
        if record is not None and record.known_to_worker and record.request_id in forget:
            record.known_to_worker = False
            desc.finished_seq_ids.append(record.seq_id)
    seq_ids, starts, counts, samples, from_prompt = [], [], [], [], []
    inline: list[int] = []
    block_counts: list[int] = []
    blocks: list[int] = []
    for seq in plan.seqs:
        record = records[seq.request_id]
        if not record.known_to_worker:
            record.known_to_worker = True
            desc.new_seqs.append(
                hp.NewSequence(
                    seq_id=record.seq_id,
                    prompt_handle=record.prompt_handle,
                    prompt_ids=record.prompt_ids,
                    prompt_len=record.prompt_len,
                    sampling=record.sampling,
                    traceparent=record.traceparent,
                    output_ids=record.output_ids,
                )
            )
        n = len(seq.token_ids)
        in_prompt = max(0, min(record.prompt_len, seq.start_pos + n) - seq.start_pos)
        seq_ids.append(record.seq_id)
        starts.append(seq.start_pos)
        counts.append(n)
        samples.append(seq.sample)
        from_prompt.append(in_prompt)
        inline.extend(seq.token_ids[in_prompt:])
        block_counts.append(len(seq.block_table))
        blocks.extend(seq.block_table)
    desc.seq_ids.extend(seq_ids)
    desc.start_pos.extend(starts)
    desc.num_tokens.extend(counts)
    desc.sample.extend(samples)
    desc.from_prompt.extend(from_prompt)
    desc.inline_tokens.extend(inline)
    desc.block_counts.extend(block_counts)
    desc.blocks.extend(blocks)
    return desc


# Alternatives per sampled request, kept beside the core (which only needs the token).
TopLogprobs = dict[str, list[tuple[int, float]]]


def decode_outcome(
    outcome: hp.StepOutcome, by_seq: dict[int, RequestRecord]
) -> tuple[StepResult, TopLogprobs]:
    sampled: dict[str, tuple[int, float]] = {}
    top: TopLogprobs = {}
    n = outcome.top_n
    for i, seq_id in enumerate(outcome.seq_ids):
        record = by_seq.get(seq_id)
        if record is None:
            continue  # finished (e.g. cancelled) while the step ran
        sampled[record.request_id] = (outcome.token_ids[i], outcome.logprobs[i])
        if n:
            ids = outcome.top_ids[i * n : (i + 1) * n]
            lps = outcome.top_logprobs[i * n : (i + 1) * n]
            top[record.request_id] = [(t, lp) for t, lp in zip(ids, lps, strict=True) if t >= 0]
    return StepResult(step_id=outcome.step_id, sampled=sampled), top
