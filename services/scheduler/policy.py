"""The scheduling policy: what runs in the next step, and what the last step's tokens mean.

Pure and synchronous, with an injected clock: the service loop calls `add_request`/`cancel` as
requests come and go, `schedule()` whenever it may plan, `update()` when a step's result is
back, and sleeps until `next_wakeup()` when there is nothing to run. Every decision is also
recorded as an event (see events.py), handed out by `update()` and `drain_events()`.

Without `async_scheduling` it may plan when no plan is in flight. With it, also while one is
(at most two in flight): plan N+1 is built from the accounts as plan N left them, as if every
row of N that samples had produced its token (a PLACEHOLDER in N+1, see plan.py; its KV slot is
already reserved, and a request whose last token N samples gets no row). What update(N) then
reveals is reconciled without touching plan N+1: a request that finished (stop, length, error),
was cancelled, expired or was preempted has its blocks freed at once, and its `valid_from`
moved past every plan already made, so update(N+1) drops its row. The freed blocks can only go
to plans made later, which the worker runs after N+1: a block is never written by a new owner
before the plans that still read it for the old one. Blocks are offered to the prefix cache only
by update() of the plan that computed them.

A step is built in three passes, so its cost grows with the batch, never with the queue or the
pool:
  1. (running.py) running sequences, highest effective priority first: decodes and prefill
     chunks; when blocks run out the lowest-ranked running sequence is preempted (maybe the one
     asking);
  2. (admission.py) waiting requests, best effective priority first, within the step's token
     budget and max_num_seqs, preempting a lower-priority running sequence if the batch is full;
  3. (admission.py) lower-priority prefill chunks that pass 1 held back for a higher-priority
     prefill, only if no such prefill ended up in the step (`isolate_priority_prefill`).
While higher-priority requests keep arriving, lower-priority prefill is held to a share of each
step (`lower_priority_prefill_tokens`). The step is written into a StepBuilder (builder.py);
its result is applied by results.py.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import NamedTuple

from services.scheduler import admission, results, running
from services.scheduler.block_manager import BlockManager
from services.scheduler.builder import StepBuilder
from services.scheduler.config import SchedulerConfig
from services.scheduler.deadlines import Deadlines
from services.scheduler.errors import InvalidRequest, QueueFull
from services.scheduler.events import Event, Finished, FinishReason, Preempted, Queued
from services.scheduler.long_prefills import LongPrefills
from services.scheduler.plan import StepPlan, StepResult
from services.scheduler.priority_traffic import PriorityTraffic
from services.scheduler.request import Request, RequestState, Status
from services.scheduler.sessions import SessionPins
from services.scheduler.stats import SchedulerStats, snapshot
from services.scheduler.waiting import WaitingQueue
from services.scheduler.window import BatchWindow

# Weight of the newest step duration in the moving average used to judge deadlines.
_STEP_ALPHA = 0.2


def _rank_key(req: RequestState) -> tuple[float, int]:
    return (-req.rank, req.order)


class Flight(NamedTuple):
    plan: StepPlan
    # The request behind each row of the plan.
    reqs: list[RequestState]
    # Clock time the plan was made.
    planned_at: float


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self.blocks = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.sessions = SessionPins(
            self.blocks, int(config.num_kv_blocks * config.session_kv_fraction)
        )
        self.waiting = WaitingQueue(config.aging_per_s)
        # Sorted by (rank descending, submission order): the tail is the preemption victim.
        self.running: list[RequestState] = []
        self.requests: dict[str, RequestState] = {}
        self.deadlines = Deadlines()
        self.window = BatchWindow(config.max_wait_s, config.window_max_seqs)
        self.events: list[Event] = []
        # Requests the worker may forget, sent with the next non-empty plan.
        self.forget: list[str] = []
        # Plans sent and not yet answered, oldest first: one, or two with async_scheduling.
        self.flights: deque[Flight] = deque()
        self._max_flights = 2 if config.async_scheduling else 1
        # When the last result was applied: with two plans in flight a step starts then.
        self._last_update = 0.0
        self.step_s_ewma = 0.0
        self.long_prefills = LongPrefills()
        self.num_preempted_waiting = 0
        self.traffic = PriorityTraffic(config.priority_horizon_s)
        # Requests preempted by the schedule() call under way: admission leaves them be.
        self.preempted_now: set[RequestState] = set()
        self._next_order = 0
        # The id of the next non-empty plan (the one being built, inside schedule()).
        self.next_step_id = 0
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_finished: Counter[str] = Counter()

    # -- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise InvalidRequest (bad field) or QueueFull (backpressure)."""
        if request.request_id in self.requests:
            raise InvalidRequest("request_id", f"{request.request_id!r} is already in flight")
        admission.validate(request, self.config)
        cfg, waiting = self.config, self.waiting
        if waiting.count >= cfg.max_waiting_requests:
            raise QueueFull(f"{waiting.count} requests already waiting")
        if waiting.num_tokens + len(request.prompt_token_ids) > cfg.max_waiting_tokens:
            raise QueueFull(f"{waiting.num_tokens} prompt tokens already waiting")
        now = self.clock()
        arrival = now if request.arrival_time is None else request.arrival_time
        req = RequestState(
            request,
            arrival,
            self._next_order,
            cfg.block_size,
            hash_blocks=cfg.enable_prefix_caching,
        )
        self._next_order += 1
        self.requests[req.request_id] = req
        waiting.push(req)
        self.deadlines.add(req)
        self.window.on_arrival(now)
        self.traffic.on_arrival(req.priority, now)
        self.events.append(Queued(req.request_id, now, waiting.count))

    def cancel(self, request_id: str) -> bool:
        """Finish a request as cancelled and free its blocks now; False if it is not known."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish(req, "cancelled", self.clock())
        return True

    def fail_all(self, reason: str) -> list[Event]:
        """The worker died: every request ends with "error", and all KV accounts start over."""
        now = self.clock()
        for req in self.requests.values():
            req.status = Status.FINISHED
            self.num_finished["error"] += 1
            self.events.append(
                Finished(req.request_id, now, "error", req.num_output_tokens, reason)
            )
        self.requests.clear()
        self.running.clear()
        self.waiting = WaitingQueue(self.config.aging_per_s)
        self.deadlines.clear()
        self.sessions.clear()
        self.blocks.reset()
        self.window.reset()
        self.forget.clear()
        self.flights.clear()
        self.long_prefills.clear()
        self.num_preempted_waiting = 0
        self.preempted_now.clear()
        self.traffic.clear()
        return self.drain_events()

    def drain_events(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step's batch. A non-empty plan must be answered by `update`; with
        `async_scheduling` the next call may come before that answer (one more plan in flight),
        otherwise it must come after. An empty plan needs no answer (its finished ids wait for
        the next plan)."""
        if len(self.flights) >= self._max_flights:
            raise RuntimeError(
                f"schedule() called while {len(self.flights)} plan(s) await update()"
            )
        now = self.clock()
        self.preempted_now.clear()
        self._expire(now)
        cfg = self.config
        top = self.traffic.top(now) if cfg.lower_priority_prefill_tokens else None
        builder = StepBuilder(
            cfg.max_num_batched_tokens,
            top,
            cfg.lower_priority_prefill_tokens,
            cfg.enable_chunked_prefill,
        )
        floor: tuple[int, float] | None = None
        head = self.waiting.peek()
        if cfg.isolate_priority_prefill and head is not None:
            floor = (head.priority, head.effective_priority(now, cfg.aging_per_s))
        deferred = running.schedule_running(self, builder, floor)
        admission.admit(self, builder, now)
        if deferred:
            admission.schedule_deferred(self, builder, deferred)
        if not builder.num_rows:
            return StepPlan(self.next_step_id)
        plan, reqs = builder.plan(self.next_step_id, self.forget)
        self.next_step_id += 1
        self.forget = []
        self.flights.append(Flight(plan, reqs, now))
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[Event]:
        """Apply a step's sampled tokens (plans are answered in the order they were made);
        returns every event since the last drain."""
        flights = self.flights
        if not flights or plan is not flights[0].plan:
            raise ValueError(
                f"step {plan.step_id} is not the plan in flight (or not the oldest of them)"
            )
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} given for step {plan.step_id}")
        now = self.clock()
        flight = flights.popleft()
        # With two plans in flight this one started when the previous result came back.
        step_s = now - max(flight.planned_at, self._last_update)
        self._last_update = now
        if self.step_s_ewma == 0.0:
            self.step_s_ewma = step_s
        else:
            self.step_s_ewma += _STEP_ALPHA * (step_s - self.step_s_ewma)
        if results.apply(self, plan, flight.reqs, result.sampled, now):
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return self.drain_events()

    @property
    def num_in_flight(self) -> int:
        return len(self.flights)

    # -- shared by the passes ----------------------------------------------------------------

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
        self.events.append(Preempted(req.request_id, now, req.num_computed_tokens, cause))
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
        bisect.insort(self.running, req, key=_rank_key)
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
        del self.requests[req.request_id]
        self.num_finished[reason] += 1
        self.events.append(Finished(req.request_id, now, reason, req.num_output_tokens, message))

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
            self.forget.append(req.request_id)

    def _expire(self, now: float) -> None:
        # A waiting request whose deadline falls within one step cannot produce a token in time.
        for req in self.deadlines.pop_waiting(now + self.step_s_ewma):
            self.finish(req, "deadline", now, "could not start before the deadline")
        for req in self.deadlines.pop_running(now):
            self.finish(req, "deadline", now, "the deadline passed while it ran")

    # -- for the service loop ----------------------------------------------------------------

    def next_wakeup(self) -> float | None:
        """Clock time at which `schedule()` has something to do even if nothing arrives (a batch
        window closes, a deadline passes); None if only an arrival or a result can change
        anything. The service loop sleeps until then instead of polling."""
        times: list[float] = []
        if self.waiting.count and not self.running and self.window.closes_at is not None:
            times.append(self.window.closes_at)
        waiting_deadline = self.deadlines.next_waiting()
        if waiting_deadline is not None:
            times.append(waiting_deadline - self.step_s_ewma)
        running_deadline = self.deadlines.next_running()
        if running_deadline is not None:
            times.append(running_deadline)
        return min(times) if times else None

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return snapshot(self)
