"""The first pass of a step: rows for the running sequences, decodes on the shortest path.

This is the loop whose cost is `schedule()`'s cost at steady state, so it reads locals only and
allocates nothing: a decode row is three appends (see builder.py). Preemption only ever pops
the running list's tail, which the loop has not reached yet (or is the current request, and
then the loop ends).
"""

from __future__ import annotations

import math

from services.protocol import PLACEHOLDER
from services.scheduler.builder import StepBuilder
from services.scheduler.request import RequestState
from services.scheduler.state import SchedulerState


def schedule_running(
    s: SchedulerState, b: StepBuilder, floor: tuple[int, float] | None
) -> list[tuple[RequestState, int]]:
    """A row for every running sequence the budget allows; returns the prefills held back for
    the waiting head (`floor`: its priority and effective priority), if any."""
    bs = s.config.block_size
    threshold = s.config.long_prefill_token_threshold
    blocks = s.blocks
    add_req, add_start, add_token = (
        b.decode_reqs.append,
        b.decode_starts.append,
        b.decode_tokens.append,
    )
    budget = b.budget
    b.floor_priority = floor[0] if floor is not None else None
    below = floor[0] if floor is not None else -math.inf
    # Decodes of lower priority than the waiting head (see StepBuilder.outranked_decodes).
    outranked = 0
    # Held-back prefills, with their preemption count: one preempted (and maybe re-admitted)
    # by the admission pass is not theirs to schedule any more.
    deferred: list[tuple[RequestState, int]] = []
    for req in s.running:
        if budget <= 0:
            break
        n = req.num_computed_tokens
        if req.decoding:
            if n >= req.decode_limit:
                if n >= req.last_pos:
                    # The token a plan in flight samples is its last (max_tokens): no more rows.
                    continue
                if n >= req.capacity:  # this row's own slot opens a block
                    if not blocks.num_free and not s.make_room(1, req):
                        break
                    req.add_block(blocks.allocate_one())
                elif n + 1 < req.last_pos and blocks.num_free:
                    # The row fills its block's last slot: the next row's block now, from the
                    # free list only, so the next step's table is this one's and the worker
                    # can replay it ahead (engine/cuda_graphs.py).
                    req.add_block(blocks.allocate_one())
            # PLACEHOLDER if the plan in flight samples it (async scheduling).
            add_token(req.last_token)
            add_req(req)
            add_start(n)
            req.num_computed_tokens = n + 1
            req.last_token = PLACEHOLDER
            budget -= 1
            if req.priority < below:
                outranked += 1
            continue
        if floor is not None and req.priority < floor[0] and req.rank < floor[1]:
            deferred.append((req, req.num_preemptions))
            continue
        chunk = b.next_chunk(req, budget, threshold)
        if not chunk:
            continue
        end = n + chunk
        if end > req.capacity:
            need = -(-end // bs) - len(req.block_ids)
            if need > blocks.num_free and not s.make_room(need, req):
                break
            req.set_blocks(req.block_ids + blocks.allocate(need))
        b.budget = budget
        b.add_prefill(req, n, end)
        budget = b.budget
        if end == len(req.token_ids) and req.long_prefill:
            s.long_prefills.remove(req)
    b.budget = budget
    b.outranked_decodes = outranked
    return deferred
