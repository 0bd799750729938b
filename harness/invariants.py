"""A full consistency check of the scheduler's books: O(pool + requests), for tests and debugging.

Raises InvariantViolation naming every problem found; silent when the books balance.
"""

from __future__ import annotations

from collections import Counter

from services.protocol import PLACEHOLDER
from services.scheduler.request import Status
from services.scheduler.state import SchedulerState


class InvariantViolation(Exception):
    """The scheduler's bookkeeping is inconsistent: a bug."""


def check(s: SchedulerState) -> None:
    problems = _request_problems(s) + _block_problems(s) + _flight_problems(s)
    if problems:
        raise InvariantViolation("; ".join(problems))


def _request_problems(s: SchedulerState) -> list[str]:
    out: list[str] = []
    running_ids = [r.seq_id for r in s.running]
    waiting = s.waiting.live()
    waiting_ids = [r.seq_id for r in waiting]
    if len(set(running_ids)) != len(running_ids):
        out.append("a request is in the running list twice")
    if len(set(waiting_ids)) != len(waiting_ids):
        out.append("a request is in the waiting queue twice")
    if set(running_ids) & set(waiting_ids):
        out.append(f"running and waiting at once: {set(running_ids) & set(waiting_ids)}")
    if set(running_ids) | set(waiting_ids) != set(s.requests):
        out.append("the request table does not match running + waiting")
    if len(s.running) > s.config.max_num_seqs:
        out.append(f"{len(s.running)} running > max_num_seqs")
    for r in s.running:
        if r.status is not Status.RUNNING or s.requests.get(r.seq_id) is not r:
            out.append(f"{r.seq_id} in the running list with status {r.status}")
        if r.decoding:
            # Tokens sampled by plans in flight, not known yet: at most one per plan.
            pending = r.num_computed_tokens + 1 - len(r.token_ids)
            if r.num_computed_tokens < r.num_prompt_tokens or not 0 <= pending <= len(s.flights):
                out.append(f"{r.seq_id} decoding with {pending} tokens pending")
            elif (r.last_token == PLACEHOLDER) != (pending > 0) or (
                not pending and r.last_token != r.token_ids[-1]
            ):
                out.append(f"{r.seq_id}: last_token {r.last_token} with {pending} pending")
    for r in waiting:
        if s.requests.get(r.seq_id) is not r:
            out.append(f"{r.seq_id} waiting but not in the request table")
        if r.block_ids or r.num_computed_tokens:
            out.append(f"{r.seq_id} waits while holding blocks or computed tokens")
    if s.waiting.count != len(waiting):
        out.append(f"waiting count {s.waiting.count} != {len(waiting)} live entries")
    if s.waiting.num_tokens != sum(len(r.token_ids) for r in waiting):
        out.append("waiting token count is off")
    preempted = sum(1 for r in waiting if r.status is Status.PREEMPTED)
    if s.num_preempted_waiting != preempted:
        out.append(f"preempted count {s.num_preempted_waiting} != {preempted}")
    keys = [(-r.rank, r.order) for r in s.running]
    if keys != sorted(keys):
        out.append("the running list is not in rank order")
    by_priority = Counter(r.priority for r in s.running if r.long_prefill)
    if by_priority != s.long_prefills.by_priority:
        counted = dict(s.long_prefills.by_priority)
        out.append(f"long prefills by priority {counted} != {dict(by_priority)}")
    for p, n in by_priority.items():
        # Admission counts those at and above a level, so each level alone stays within it.
        if n > s.config.max_long_prefills:
            out.append(f"{n} long prefills at priority {p} > max_long_prefills")
    return out


def _block_problems(s: SchedulerState) -> list[str]:
    out: list[str] = []
    bm, bs = s.blocks, s.config.block_size
    holders: Counter[int] = Counter()
    for r in s.running:
        holders.update(r.block_ids)
        if len(set(r.block_ids)) != len(r.block_ids):
            out.append(f"{r.seq_id} holds a block twice")
        if r.block_table != tuple(r.block_ids):
            out.append(f"{r.seq_id}: block_table out of date")
        n = r.num_computed_tokens
        needed = -(-n // bs)
        # A decode that filled its block's last slot may hold the next row's block already.
        ahead = r.decoding and n % bs == 0 and n < r.last_pos
        if not needed <= len(r.block_ids) <= needed + ahead:
            out.append(f"{r.seq_id}: {len(r.block_ids)} blocks for {r.num_computed_tokens} tokens")
        for j, block_id in enumerate(r.block_ids):
            block_hash = bm.block_hashes[block_id]
            if block_hash is not None and (
                j >= len(r.block_hashes) or r.block_hashes[j] != block_hash
            ):
                out.append(f"{r.seq_id}: block {block_id} holds another prefix")
    for _, block_ids in s.sessions.items():
        holders.update(block_ids)
    if sum(len(ids) for _, ids in s.sessions.items()) != s.sessions.num_pinned:
        out.append("session pin count is off")
    for block_id in range(bm.num_blocks):
        refs = bm.ref_counts[block_id]
        if refs != holders[block_id]:
            out.append(f"block {block_id}: ref_count {refs} != {holders[block_id]} holders")
        if (refs == 0) != bm.is_free(block_id):
            out.append(f"block {block_id}: ref_count {refs} but free={bm.is_free(block_id)}")
        if holders[block_id] > 1 and bm.block_hashes[block_id] is None:
            out.append(f"block {block_id} shared without being a cached prefix")
    if bm.num_free + sum(1 for c in bm.ref_counts if c > 0) != bm.num_blocks:
        out.append("free + used != total blocks")
    for block_hash, block_id in bm.cached.items():
        if bm.block_hashes[block_id] != block_hash:
            out.append(f"cache entry points at block {block_id} with another hash")
    if len(bm.cached) != sum(1 for h in bm.block_hashes if h is not None):
        out.append("hashed blocks and cache entries disagree")
    return out


def _flight_problems(s: SchedulerState) -> list[str]:
    """Every row of a plan in flight either still speaks for its request's blocks (the request
    runs and its table starts with the row's) or is marked dead (valid_from)."""
    out: list[str] = []
    ids = [f.plan.step_id for f in s.flights]
    if ids != list(range(s.next_step_id - len(ids), s.next_step_id)):
        out.append(f"plans in flight {ids} are not the last ones made ({s.next_step_id})")
    largest = s.config.largest_step_tokens
    for flight in s.flights:
        plan = flight.plan
        if plan.num_prefill_tokens > largest:
            # Decode rows may go past the budget (isolate_priority_prefill), prompts never.
            out.append(f"step {plan.step_id}: {plan.num_prefill_tokens} prompt tokens > {largest}")
        if len(flight.reqs) != plan.num_seqs:
            out.append(f"step {plan.step_id}: {len(flight.reqs)} requests for {plan.num_seqs} rows")
        for req, table in zip(flight.reqs, plan.block_tables, strict=False):
            if req.valid_from > plan.step_id:
                continue
            if req.status is not Status.RUNNING:
                out.append(f"step {plan.step_id}: live row of {req.seq_id} ({req.status})")
            elif req.block_table[: len(table)] != table:
                out.append(f"step {plan.step_id}: {req.seq_id}'s row has another block table")
    for r in s.requests.values():
        if r.valid_from > s.next_step_id:
            out.append(f"{r.seq_id}: valid_from {r.valid_from} > next step {s.next_step_id}")
    return out
