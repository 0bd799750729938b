"""How a step's result lands: full blocks offered to the prefix cache, sampled tokens appended
and streamed, stop conditions checked; rows of requests that lost their blocks since the plan
was made (async scheduling: up to two plans are in flight) are dropped whole."""

from __future__ import annotations

from collections.abc import Sequence

from services.protocol import StepPlan, StepResult
from services.scheduler.events import Token
from services.scheduler.request import RequestState
from services.scheduler.state import SchedulerState

# Token(...) runs the NamedTuple's __new__, a Python function; making the tuple directly skips
# that frame, which is most of the cost of one event per token per step.
new_tuple = tuple.__new__


def apply(
    s: SchedulerState, plan: StepPlan, reqs: Sequence[RequestState], result: StepResult, now: float
) -> bool:
    """Apply one step's outcome to the requests it ran; True if any of them finished (the
    caller then drops them from the running list in one pass)."""
    bs = s.config.block_size
    sampled, failed = result.sampled, result.failed
    blocks, events = s.blocks, s.events
    step_id = plan.step_id
    any_finished = False
    rows = zip(reqs, plan.start_pos, plan.num_tokens, plan.sample, strict=True)
    for req, start, count, sample in rows:
        if req.valid_from > step_id:
            # Finished, cancelled or preempted since this plan was made: its blocks are gone
            # (maybe to another sequence already), so nothing it computed counts.
            continue
        if failed and req.seq_id in failed:
            why = f"INTERNAL: the worker could not run the request: {failed[req.seq_id]}"
            s.finish(req, "error", now, why, unlink=False)
            any_finished = True
            continue
        # Blocks this row filled are computed now, and only now offered to the prefix cache.
        full = (start + count) // bs
        if req.num_registered_blocks < full:
            hashes, ids = req.block_hashes, req.block_ids
            for j in range(req.num_registered_blocks, min(full, len(hashes))):
                blocks.register(ids[j], hashes[j])
            req.num_registered_blocks = full
        if not sample:
            continue
        out = sampled.get(req.seq_id)
        if out is None:
            s.finish(req, "error", now, "the worker returned no token", unlink=False)
            any_finished = True
            continue
        token_id, logprob = out
        tokens = req.token_ids
        tokens.append(token_id)
        n = len(tokens)
        if req.num_computed_tokens < n:
            # No later plan in flight samples it: the next decode row carries this token.
            req.last_token = token_id
        if n % bs == 0:
            req.extend_hashes()
        index = n - req.num_prompt_tokens - 1
        events.append(new_tuple(Token, (req.seq_id, token_id, logprob, index)))
        if token_id in req.stop_token_ids:
            s.finish(req, "stop", now, unlink=False)
            any_finished = True
        elif n > req.last_pos:
            s.finish(req, "length", now, unlink=False)
            any_finished = True
    return any_finished
