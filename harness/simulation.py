"""The event-driven loop the service runs, on simulated time: arrivals, cancels, steps.

It behaves like the real service loop: the worker runs plans one at a time, in order; the
scheduler plans as soon as it may (when the worker is free, or, with `async_scheduling`, while
it runs the one plan before); with nothing to run, time jumps to the next arrival or to
`Scheduler.next_wakeup()` (never polling). Optionally the loop pays what the real one pays and
the simulated worker cannot see: a hop each way between scheduler and worker (`hop_s`), and
the scheduler's own time (`charge_scheduler`: the measured wall time of every `schedule()` and
`update()` call, during which the scheduler can do nothing else). What happened to each request
is kept in a RequestRecord for tests and the benchmark.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from harness.sim_worker import CostModel, SimClock, SimWorker
from services.protocol import StepPlan, StepResult
from services.scheduler.errors import SchedulerError
from services.scheduler.events import Event, Finished, Preempted, Scheduled, Token
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

_T = TypeVar("_T")


@dataclass
class RequestRecord:
    request: Request
    submitted_at: float
    # Why add_request refused it (backpressure or a bad field), if it did.
    rejected: str | None = None
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    reason: str | None = None
    tokens: list[int] = field(default_factory=list)
    # When each token reached the scheduler's event stream (the client one hop later).
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def queue_wait(self) -> float | None:
        return None if self.scheduled_at is None else self.scheduled_at - self.submitted_at

    @property
    def inter_token_latencies(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


@dataclass
class StepLog:
    start: float
    duration: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int


class Simulation:
    def __init__(
        self,
        scheduler: Scheduler,
        clock: SimClock,
        worker: SimWorker,
        cost: CostModel | None = None,
        after_step: Callable[[Scheduler], None] | None = None,
        hop_s: float = 0.0,
        charge_scheduler: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.worker = worker
        self.cost = cost or CostModel()
        # Called after every schedule() that made a plan and every update(), e.g. with
        # invariants.check.
        self.after_step = after_step
        self.hop_s = hop_s
        self.charge_scheduler = charge_scheduler
        self.max_in_flight = 2 if scheduler.config.async_scheduling else 1
        self.records: dict[int, RequestRecord] = {}
        self.steps: list[StepLog] = []
        self.events: list[tuple[float, Event]] = []
        self.keep_events = False
        # Wall time the scheduler spent in schedule() and update() (charged or not).
        self.scheduler_s = 0.0
        # (time, tie-break, action): arrivals and cancellations yet to happen.
        self._pending: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        # Plans on their way to the worker or queued there: (plan, time it arrives).
        self._to_worker: deque[tuple[StepPlan, float]] = deque()
        # The plan the worker is running, its result, and when it completes.
        self._running: tuple[StepPlan, StepResult, float] | None = None
        # Results on their way back: (plan, result, time it arrives).
        self._to_scheduler: deque[tuple[StepPlan, StepResult, float]] = deque()
        self._in_flight = 0
        self._num_updates = 0
        # The scheduler is busy (in a charged call) until then.
        self._busy_until = 0.0
        # Whether anything happened since the last schedule() that returned an empty plan.
        self._dirty = True

    def submit(self, request: Request, at: float | None = None) -> None:
        if at is None:
            at = request.arrival_time if request.arrival_time is not None else self.clock.now
        self._at(at, lambda: self._arrive(request))

    def cancel(self, seq_id: int, at: float) -> None:
        self._at(at, lambda: self._cancel(seq_id))

    def run(self, until: float | None = None, max_steps: int | None = None) -> None:
        """Advance until nothing is left to happen, simulated time `until`, or `max_steps` more
        steps have completed; a later call carries on where this one stopped."""
        sched, clock = self.scheduler, self.clock
        stop_at = None if max_steps is None else self._num_updates + max_steps
        while True:
            now = clock.now
            self._run_worker(now)
            free = self._busy_until <= now
            if free and self._to_scheduler and self._to_scheduler[0][2] <= now:
                plan, result, _ = self._to_scheduler.popleft()
                self._in_flight -= 1
                self._num_updates += 1
                events = self._call(partial(sched.update, plan, result))
                self._absorb(events, self._busy_until if self.charge_scheduler else now)
                if self.after_step is not None:
                    self.after_step(sched)
                self._dirty = True
                continue
            while self._pending and self._pending[0][0] <= now:
                heapq.heappop(self._pending)[2]()
                self._dirty = True
            self._absorb(sched.drain_events(), now)
            if stop_at is not None and self._num_updates >= stop_at:
                return
            can_plan = free and self._in_flight < self.max_in_flight and sched.has_unfinished()
            if can_plan and self._dirty:
                plan = self._call(sched.schedule)
                self._absorb(sched.drain_events(), now)
                if plan.is_empty:
                    self._dirty = False
                else:
                    self._in_flight += 1
                    sent = self._busy_until if self.charge_scheduler else now
                    self._to_worker.append((plan, sent + self.hop_s))
                    if self.after_step is not None:
                        self.after_step(sched)
                continue
            t = self._next_time(now, can_plan)
            if t is None:
                return
            if until is not None and t > until:
                clock.advance_to(max(now, until))
                return
            clock.advance_to(t)
            if t > now:
                self._dirty = True

    def _next_time(self, now: float, can_plan: bool) -> float | None:
        times = [self._pending[0][0]] if self._pending else []
        if self._running is not None:
            times.append(self._running[2])
        elif self._to_worker:
            times.append(self._to_worker[0][1])
        if self._to_scheduler:
            times.append(max(self._to_scheduler[0][2], self._busy_until))
        if self._busy_until > now and self.scheduler.has_unfinished():
            times.append(self._busy_until)
        if can_plan:
            wakeup = self.scheduler.next_wakeup()
            # A wake-up already due was just served by the empty schedule() before.
            if wakeup is not None and wakeup > now:
                times.append(wakeup)
        return min(times) if times else None

    def _call(self, fn: Callable[[], _T]) -> _T:
        start = time.perf_counter()
        out = fn()
        spent = time.perf_counter() - start
        self.scheduler_s += spent
        if self.charge_scheduler:
            self._busy_until = self.clock.now + spent
        return out

    def _run_worker(self, now: float) -> None:
        while True:
            running = self._running
            if running is not None and running[2] <= now:
                plan, result, done = running
                self._to_scheduler.append((plan, result, done + self.hop_s))
                self._running = None
            if self._running is None and self._to_worker and self._to_worker[0][1] <= now:
                plan, arrived = self._to_worker.popleft()
                start = max(arrived, running[2] if running is not None else arrived)
                self._start(plan, start)
                continue
            return

    def _start(self, plan: StepPlan, start: float) -> None:
        result = self.worker.execute(plan)
        duration = self.cost.step_time(plan)
        self._running = (plan, result, start + duration)
        self.steps.append(
            StepLog(
                start,
                duration,
                plan.num_seqs,
                plan.num_prefill_tokens,
                plan.num_decode_tokens,
            )
        )

    def _at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._pending, (t, self._seq, action))
        self._seq += 1

    def _cancel(self, seq_id: int) -> None:
        self.scheduler.cancel(seq_id)

    def _arrive(self, request: Request) -> None:
        record = RequestRecord(request, self.clock.now)
        self.records[request.seq_id] = record
        self.worker.register(request)
        try:
            self.scheduler.add_request(request)
        except SchedulerError as err:
            record.rejected = str(err)

    def _absorb(self, events: list[Event], now: float) -> None:
        records = self.records
        for event in events:
            if self.keep_events:
                self.events.append((now, event))
            if isinstance(event, Token):
                record = records[event.seq_id]
                if record.first_token_at is None:
                    record.first_token_at = now
                record.tokens.append(event.token_id)
                record.token_times.append(now)
            elif isinstance(event, Scheduled):
                records[event.seq_id].scheduled_at = now
            elif isinstance(event, Preempted):
                records[event.seq_id].preemptions += 1
            elif isinstance(event, Finished):
                records[event.seq_id].finished_at = now
                records[event.seq_id].reason = event.reason
