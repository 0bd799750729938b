"""The event-driven loop the service will run, on simulated time: arrivals, cancels, steps.

It behaves like the real service loop: the worker runs one plan at a time; when it is free the
scheduler is asked for the next plan at once; with nothing to run, time jumps to the next
arrival or to `Scheduler.next_wakeup()` (never polling). What happened to each request is kept
in a RequestRecord for tests and the benchmark.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.errors import SchedulerError
from services.scheduler.events import Event, Finished, Preempted, Scheduled, Token
from services.scheduler.plan import StepPlan, StepResult
from services.scheduler.policy import Scheduler
from services.scheduler.request import Request
from services.scheduler.simulator import CostModel, SimClock, SimWorker


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
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def queue_wait(self) -> float | None:
        return None if self.scheduled_at is None else self.scheduled_at - self.submitted_at


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
    ) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.worker = worker
        self.cost = cost or CostModel()
        # Called after every update(), e.g. with invariants.check.
        self.after_step = after_step
        self.records: dict[str, RequestRecord] = {}
        self.steps: list[StepLog] = []
        self.events: list[tuple[float, Event]] = []
        self.keep_events = False
        # (time, tie-break, action): arrivals and cancellations yet to happen.
        self._pending: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        # The step the worker is running, its result, and when it completes.
        self._plan: StepPlan | None = None
        self._result: StepResult | None = None
        self._done_at = 0.0

    def submit(self, request: Request, at: float | None = None) -> None:
        if at is None:
            at = request.arrival_time if request.arrival_time is not None else self.clock.now
        self._at(at, lambda: self._arrive(request))

    def cancel(self, request_id: str, at: float) -> None:
        self._at(at, lambda: self._cancel(request_id))

    def run(self, until: float | None = None, max_steps: int | None = None) -> None:
        """Advance until nothing is left to happen, simulated time `until`, or `max_steps` more
        steps have completed; a later call carries on where this one stopped."""
        sched, clock = self.scheduler, self.clock
        stop_at = None if max_steps is None else len(self.steps) + max_steps
        idle_since = -1.0
        while True:
            if self._plan is None and sched.has_unfinished():
                plan = sched.schedule()
                self._absorb(sched.drain_events())
                if plan.is_empty:
                    idle_since = clock.now
                else:
                    self._start(plan)
            times = [self._pending[0][0]] if self._pending else []
            if self._plan is not None:
                times.append(self._done_at)
            else:
                wakeup = sched.next_wakeup()
                # A wake-up already due was just served by the empty schedule() above.
                if wakeup is not None and not (wakeup <= clock.now and idle_since == clock.now):
                    times.append(max(wakeup, clock.now))
            if not times:
                return
            t = min(times)
            if until is not None and t > until:
                clock.advance_to(max(clock.now, until))
                return
            clock.advance_to(t)
            if self._plan is not None and self._result is not None and t >= self._done_at:
                self._absorb(sched.update(self._plan, self._result))
                self._plan = self._result = None
                if self.after_step is not None:
                    self.after_step(sched)
            while self._pending and self._pending[0][0] <= clock.now:
                heapq.heappop(self._pending)[2]()
            self._absorb(sched.drain_events())
            if stop_at is not None and len(self.steps) >= stop_at and self._plan is None:
                return

    def _start(self, plan: StepPlan) -> None:
        self._plan = plan
        self._result = self.worker.execute(plan)
        duration = self.cost.step_time(plan)
        self._done_at = self.clock.now + duration
        self.steps.append(
            StepLog(
                self.clock.now,
                duration,
                plan.num_seqs,
                plan.num_prefill_tokens,
                plan.num_decode_tokens,
            )
        )

    def _at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._pending, (t, self._seq, action))
        self._seq += 1

    def _cancel(self, request_id: str) -> None:
        self.scheduler.cancel(request_id)

    def _arrive(self, request: Request) -> None:
        record = RequestRecord(request, self.clock.now)
        self.records[request.request_id] = record
        self.worker.register(request)
        try:
            self.scheduler.add_request(request)
        except SchedulerError as err:
            record.rejected = str(err)

    def _absorb(self, events: list[Event]) -> None:
        now = self.clock.now
        records = self.records
        for event in events:
            if self.keep_events:
                self.events.append((now, event))
            if isinstance(event, Token):
                record = records[event.request_id]
                if record.first_token_at is None:
                    record.first_token_at = now
                record.tokens.append(event.token_id)
            elif isinstance(event, Scheduled):
                records[event.request_id].scheduled_at = now
            elif isinstance(event, Preempted):
                records[event.request_id].preemptions += 1
            elif isinstance(event, Finished):
                records[event.request_id].finished_at = now
                records[event.request_id].reason = event.reason
