"""The first pass of a step: rows for the running sequences, decodes on the shortest path.

This is the loop whose cost is `schedule()`'s cost at steady state, so it reads locals only and
allocates nothing but the rows. Preemption only ever pops the running list's tail, which the
loop has not reached yet (or is the current request, and then the loop ends).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from services.scheduler.admission import StepBuilder
from services.scheduler.plan import ScheduledSeq
from services.scheduler.request import RequestState

if TYPE_CHECKING:
    from services.scheduler.policy import Scheduler


def schedule_running(
    s: Scheduler, b: StepBuilder, floor: tuple[int, float] | None
) -> list[tuple[RequestState, int]]:
    """A row for every running sequence the budget allows; returns the prefills held back for
    the waiting head (`floor`: its priority and effective priority), if any."""
    bs = s.config.block_size
    threshold = s.config.long_prefill_token_threshold
    chunked = s.config.enable_chunked_prefill
    blocks = s.blocks
    add_row, add_req, row = b.seqs.append, b.reqs.append, ScheduledSeq
    budget = b.budget
    rows_before = len(b.seqs)
    prefill_rows = 0
    # Decodes of lower priority than the waiting head (see StepBuilder.outranked_decodes).
    floor_priority = floor[0] if floor is not None else None
    b.floor_priority = floor_priority
    outranked = 0
    below = floor_priority if floor_priority is not None else -math.inf
    # Held-back prefills, with their preemption count: one preempted (and maybe re-admitted)
    # by the admission pass is not theirs to schedule any more.
    deferred: list[tuple[RequestState, int]] = []
    for req in s.running:
        if budget <= 0:
            break
        n = req.num_computed_tokens
        if req.decoding:
            if n >= req.capacity:
                if not blocks.num_free and not s.make_room(1, req):
                    break
                req.set_blocks(req.block_ids + blocks.allocate(1))
            add_row(row(req.request_id, req.token_ids[n:], n, req.block_table, True, req.sampling))
            add_req(req)
            req.num_computed_tokens = n + 1
            budget -= 1
            if req.priority < below:
                outranked += 1
            continue
        tokens = req.token_ids
        total = len(tokens)
        if floor is not None and req.priority < floor[0] and req.rank < floor[1]:
            deferred.append((req, req.num_preemptions))
            continue
        chunk = min(total - n, budget, threshold) if req.long_prefill else min(total - n, budget)
        end = n + chunk
        if not chunked and end < total:
            continue
        if end > req.capacity:
            need = -(-end // bs) - len(req.block_ids)
            if need > blocks.num_free and not s.make_room(need, req):
                break
            req.set_blocks(req.block_ids + blocks.allocate(need))
        sample = end == total
        add_row(row(req.request_id, tokens[n:end], n, req.block_table, sample, req.sampling))
        add_req(req)
        req.num_computed_tokens = end
        budget -= chunk
        prefill_rows += 1
        b.num_prefill_tokens += chunk
        b.note_prefill(req.priority, req.rank)
        if sample and req.long_prefill:
            s.long_prefills.remove(req)
    b.budget = budget
    b.num_decode_tokens += len(b.seqs) - rows_before - prefill_rows
    b.outranked_decodes = outranked
    return deferred
