"""Admission: which waiting requests join the step being built, and what they displace (the
second and third passes of `Scheduler.schedule`, see scheduler.py)."""

from __future__ import annotations

import math

from services.scheduler.builder import StepBuilder
from services.scheduler.config import SchedulerConfig
from services.scheduler.errors import InvalidRequest
from services.scheduler.events import Resumed, Scheduled
from services.scheduler.request import Request, RequestState, Status
from services.scheduler.state import SchedulerState


def validate(request: Request, cfg: SchedulerConfig) -> None:
    if not isinstance(request.seq_id, int) or request.seq_id < 0:
        raise InvalidRequest("seq_id", f"must be a non-negative integer, got {request.seq_id!r}")
    n = len(request.prompt_token_ids)
    if n == 0:
        raise InvalidRequest("prompt_token_ids", "must not be empty")
    if request.max_tokens < 1:
        raise InvalidRequest("max_tokens", f"must be at least 1, got {request.max_tokens}")
    if n >= cfg.max_model_len:
        raise InvalidRequest(
            "prompt_token_ids",
            f"{n} tokens leave no room to generate within max_model_len={cfg.max_model_len}",
        )
    exceeds = f"prompt ({n}) + max_tokens ({request.max_tokens}) exceeds"
    if n + request.max_tokens > cfg.max_model_len:
        raise InvalidRequest("max_tokens", f"{exceeds} max_model_len={cfg.max_model_len}")
    if n + request.max_tokens > cfg.kv_capacity_tokens:
        # A sequence that cannot fit the whole pool alone could never finish.
        raise InvalidRequest(
            "max_tokens", f"{exceeds} the KV pool of {cfg.kv_capacity_tokens} tokens"
        )
    if n > cfg.max_queued_tokens:
        # Refused at any load: not backpressure, which a client would retry.
        raise InvalidRequest(
            "prompt_token_ids",
            f"{n} tokens exceed max_queued_tokens={cfg.max_queued_tokens}, the most that may wait",
        )
    if request.deadline is not None and not math.isfinite(request.deadline):
        raise InvalidRequest("deadline", f"must be a finite clock time, got {request.deadline}")


def admit(s: SchedulerState, b: StepBuilder, now: float) -> None:
    cfg, waiting, blocks = s.config, s.waiting, s.blocks
    if not waiting.count or s.window.holds(now, waiting.count, bool(s.running)):
        return
    bs, threshold = cfg.block_size, cfg.long_prefill_token_threshold
    skipped: list[RequestState] = []
    while b.budget > 0 or b.outranked_decodes:
        head = waiting.peek()
        if head is None:
            break
        if head in s.preempted_now:
            # Preempted while this very step was built: memory or seats are short, and taking
            # it back now would only recompute what it just gave up (with a step in flight, its
            # newest blocks are not even cached yet). vLLM v1 admits no one after a preemption.
            break
        eff = head.effective_priority(now, cfg.aging_per_s)
        if cfg.isolate_priority_prefill and b.holds_back(head.priority, eff):
            break
        bonus = 0
        if b.floor_priority is not None and head.priority >= b.floor_priority:
            bonus = b.outranked_decodes
        budget = b.budget + bonus
        if budget <= 0:
            break
        # The one to preempt for the head: the lowest-ranked running sequence, if it is of lower
        # priority and has not aged past the head.
        victim = s.running[-1] if s.running else None
        if victim is not None and (victim.priority >= head.priority or victim.rank >= eff):
            victim = None
        seats_full = len(s.running) >= cfg.max_num_seqs
        if seats_full and victim is None:
            break
        total = len(head.token_ids)
        # At least the last token is recomputed: the worker needs its logits to sample.
        reusable = (total - 1) // bs if head.request.reuse_prefix else 0
        hits = blocks.lookup(head.block_hashes, reusable)
        cached = len(hits) * bs
        remaining = total - cached
        is_long = cfg.enable_chunked_prefill and remaining > threshold
        # Every reason to pass over the head comes before anyone is preempted for it.
        if is_long and s.long_prefills.at_or_above(head.priority) >= cfg.max_long_prefills:
            # Let shorter requests pass instead of blocking the queue behind it.
            skipped.append(waiting.pop())
            continue
        per_step = b.cap(head, threshold if is_long else b.size, whole=True)
        chunk = b.cap(head, min(remaining, budget, per_step))
        if chunk <= 0 or (chunk < remaining and not cfg.enable_chunked_prefill):
            break
        # This step's chunk, then whole steps' worth: what is left of this step's budget says
        # nothing about the next ones.
        steps = 1 + math.ceil((remaining - chunk) / per_step)
        if head.deadline is not None and now + s.step_s_ewma * steps > head.deadline:
            s.finish(head, "deadline", now, "could not finish its prompt before the deadline")
            continue
        num_new = -(-(cached + chunk) // bs) - len(hits)
        if not seats_full:
            while num_new + blocks.num_unreferenced(hits) > blocks.num_free:
                if not s.sessions.release_lru():
                    break
        if seats_full or num_new + blocks.num_unreferenced(hits) > blocks.num_free:
            if victim is None:
                break
            # Already in this step? Its row comes back out before its blocks go.
            b.remove(victim)
            s.preempt(victim, "priority", now)
            continue
        _start(s, b, hits, num_new, chunk, now)
        if bonus:
            b.outranked_decodes = 0  # the allowance is once per step
        if is_long:
            s.long_prefills.add(head)
    for req in skipped:
        waiting.push(req)


def _start(
    s: SchedulerState, b: StepBuilder, hits: list[int], num_new: int, chunk: int, now: float
) -> None:
    req = s.waiting.pop()
    resumed = req.status is Status.PREEMPTED
    s.blocks.acquire(hits)
    req.set_blocks(hits + s.blocks.allocate(num_new))
    req.num_registered_blocks = len(hits)
    if req.session_id is not None:
        # The new turn holds its own references now; the session's pin has done its job.
        s.sessions.release(req.session_id)
    req.waited_s += now - req.enqueue_time
    req.rank = req.priority + s.config.aging_per_s * req.waited_s
    s.start_running(req)
    req.known_to_worker = True
    cached = len(hits) * s.config.block_size
    b.add_prefill(req, cached, cached + chunk)
    b.new_sampling[req.seq_id] = req.sampling
    if resumed:
        s.num_preempted_waiting -= 1
        s.events.append(Resumed(req.seq_id, now, cached))
    else:
        s.prefix_queries += len(req.token_ids)
        s.prefix_hits += cached
        s.events.append(Scheduled(req.seq_id, now, now - req.arrival_time, cached))
    s.window.close()


def schedule_deferred(
    s: SchedulerState, b: StepBuilder, deferred: list[tuple[RequestState, int]]
) -> None:
    """Prefill chunks pass 1 held back for a more important prefill that, in the end, did not
    make it into the step. They take only free blocks: this pass preempts no one."""
    cfg, blocks = s.config, s.blocks
    bs = cfg.block_size
    for req, preemptions in deferred:
        if b.budget <= 0:
            break
        if req.num_preemptions != preemptions or b.holds_back(req.priority, req.rank):
            continue
        n = req.num_computed_tokens
        chunk = b.next_chunk(req, b.budget, cfg.long_prefill_token_threshold)
        if not chunk:
            continue
        need = -(-(n + chunk) // bs) - len(req.block_ids)
        if need > blocks.num_free:
            continue
        if need > 0:
            req.set_blocks(req.block_ids + blocks.allocate(need))
        b.add_prefill(req, n, n + chunk)
        if n + chunk == len(req.token_ids) and req.long_prefill:
            s.long_prefills.remove(req)
