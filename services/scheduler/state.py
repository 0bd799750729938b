"""The scheduler's books: every request it holds, the running list, the waiting queue, the KV
block accounts, session pins, plans in flight and counters, with the moves every pass makes on
them (start a request running, preempt one, finish one, make room). The passes of a step
(running.py, admission.py, results.py) work on this state; scheduler.py composes them.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from services.protocol import StepPlan
from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig
from services.scheduler.deadlines import Deadlines
from services.scheduler.events import Event, Finished, FinishReason, Preempted
from services.scheduler.long_prefills import LongPrefills
from services.scheduler.priority_traffic import PriorityTraffic
from services.scheduler.request import RequestState, Status
from services.scheduler.sessions import SessionPins
from services.scheduler.waiting import WaitingQueue
from services.scheduler.window import BatchWindow


class Flight(NamedTuple):
    plan: StepPlan
    # The request behind each row of the plan.
    reqs: list[RequestState]
    # Clock time the plan was made.
    planned_at: float


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    # Of the waiting requests, those that were preempted and will resume.
    num_preempted_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    # Free includes cached blocks: they are given up on demand.
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_session_pinned: int
    # Prompt tokens looked up in the prefix cache at first admission, and those found.
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_evictions: int
    num_steps: int
    # Of the steps, those planned with the backlog's budget (`backlog_batched_tokens`).
    num_backlog_steps: int
    # Finished requests by reason ("stop", "length", "cancelled", "deadline", "error").
    num_finished: Mapping[str, int]

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0


class SchedulerState:
    def __init__(
        self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self.blocks = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.events: list[Event] = []
        self.max_flights = 2 if config.async_scheduling else 1
        # When the last result was applied: with two plans in flight a step starts then.
        self._last_update = 0.0
        self.step_s_ewma = 0.0
        self._orders = itertools.count()
        # The id of the next non-empty plan (the one being built, inside schedule()).
        self.next_step_id = 0
        self.num_backlog_steps = 0
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_finished: Counter[str] = Counter()
        self._open_books()

    def _open_books(self) -> None:
        """The books of the requests in flight, empty: at the start, and after `fail_all`."""
        config = self.config
        self.sessions = SessionPins(
            self.blocks, int(config.num_kv_blocks * config.session_kv_fraction)
        )
        self.waiting = WaitingQueue(config.aging_per_s)
        # Sorted by (rank descending, submission order): the tail is the preemption victim.
        self.running: list[RequestState] = []
        self.requests: dict[int, RequestState] = {}
        self.deadlines = Deadlines()
        self.window = BatchWindow(config.max_wait_s, config.window_max_seqs)
        # Requests the worker may forget, sent with the next non-empty plan.
        self.forget: list[int] = []
        # Plans sent and not yet answered, oldest first: one, or two with async_scheduling.
        self.flights: deque[Flight] = deque()
        self.long_prefills = LongPrefills()
        self.num_preempted_waiting = 0
        self.traffic = PriorityTraffic(config.priority_horizon_s)
        # Requests preempted by the schedule() call under way: admission leaves them be.
        self.preempted_now: set[RequestState] = set()

    def fail_all(self, reason: str) -> list[Event]:
        """The worker died: every request ends with "error", and all KV accounts start over."""
        now = self.clock()
        for req in self.requests.values():
            req.status = Status.FINISHED
            self.num_finished["error"] += 1
            self.events.append(Finished(req.seq_id, now, "error", req.num_output_tokens, reason))
        self.blocks.reset()
        self._open_books()
        return self.drain_events()

    def drain_events(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    def make_room(self, need: int, req: RequestState) -> bool:
        """Free blocks until `need` are free: session pins first, then the lowest-ranked running
        sequences. False if `req` itself had to be preempted."""
        while self.blocks.num_free < need:
            if self.sessions.release_lru():
                continue
            victim = self.running[-1]
            self.preempt(victim, "kv", self.clock())
            if victim is req:
                return False
        return True

    def preempt(self, req: RequestState, cause: str, now: float) -> None:
        if self.running and self.running[-1] is req:
            self.running.pop()
        else:
            self.running.remove(req)
        self.events.append(Preempted(req.seq_id, now, req.num_computed_tokens, cause))
        self.preempted_now.add(req)
        self._drop_blocks(req)
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        req.enqueue_time = now
        self.waiting.push(req)
        self.deadlines.add(req)
        self.num_preempted_waiting += 1
        self.num_preemptions += 1

    def start_running(self, req: RequestState) -> None:
        req.status = Status.RUNNING
        bisect.insort(self.running, req, key=lambda r: (-r.rank, r.order))
        self.deadlines.add(req)

    def finish(
        self,
        req: RequestState,
        reason: FinishReason,
        now: float,
        message: str = "",
        unlink: bool = True,
    ) -> None:
        """End a request in any state; `unlink=False` leaves the running list to the caller."""
        if req.status is Status.RUNNING:
            if unlink:
                self.running.remove(req)
            if req.session_id is not None and reason in ("stop", "length"):
                bh = self.blocks.block_hashes
                self.sessions.pin(req.session_id, [b for b in req.block_ids if bh[b] is not None])
        else:
            self.waiting.discard(req)
            if req.status is Status.PREEMPTED:
                self.num_preempted_waiting -= 1
        self._drop_blocks(req)
        req.status = Status.FINISHED
        del self.requests[req.seq_id]
        self.num_finished[reason] += 1
        self.events.append(Finished(req.seq_id, now, reason, req.num_output_tokens, message))

    def _drop_blocks(self, req: RequestState) -> None:
        if req.block_ids:
            self.blocks.free(req.block_ids)
            req.set_blocks([])
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.decoding = False
        # Rows already planned for it, in plans in flight, now speak for blocks it lost.
        req.valid_from = self.next_step_id
        if req.long_prefill:
            self.long_prefills.remove(req)
        if req.known_to_worker:
            req.known_to_worker = False
            self.forget.append(req.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        s, blocks = self, self.blocks
        return SchedulerStats(
            num_running=len(s.running),
            num_waiting=s.waiting.count,
            num_preempted_waiting=s.num_preempted_waiting,
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_used=blocks.num_used,
            kv_blocks_free=blocks.num_free,
            kv_blocks_cached=blocks.num_cached,
            kv_blocks_session_pinned=s.sessions.num_pinned,
            prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits,
            num_preemptions=s.num_preemptions,
            num_evictions=blocks.num_evictions,
            num_steps=s.next_step_id,
            num_backlog_steps=s.num_backlog_steps,
            num_finished=dict(s.num_finished),
        )
