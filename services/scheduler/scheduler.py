"""The scheduling policy: what runs in the next step, and what the last step's tokens mean.

Pure and synchronous, with an injected clock: the service loop calls `add_request`/`cancel` as
requests come and go, `schedule()` whenever it may plan, `update()` when a step's result is
back, and sleeps until `next_wakeup()` when there is nothing to run. Every decision is also
recorded as an event (see events.py), handed out by `update()` and `drain_events()`.

Without `async_scheduling` it may plan when no plan is in flight. With it, also while one is
(at most two in flight): plan N+1 is built from the accounts as plan N left them, as if every
row of N that samples had produced its token (a PLACEHOLDER in N+1, see protocol.py; its KV slot is
already reserved, and a request whose last token N samples gets no row). What update(N) then
reveals is reconciled without touching plan N+1: a request that finished (stop, length, error),
was cancelled, expired or was preempted has its blocks freed at once, and its `valid_from`
moved past every plan already made, so update(N+1) drops its row. The freed blocks can only go
to plans made later, which the worker runs after N+1: a block is never written by a new owner
before the plans that still read it for the old one. Blocks are offered to the prefix cache only
by update() of the plan that computed them.

A step is built in three passes, so its cost grows with the batch, never with the queue or the
pool. Its token budget is `max_num_batched_tokens`, or `backlog_batched_tokens` while at least
that many prompt tokens wait (config.py):
  1. (running.py) running sequences, highest effective priority first: decodes and prefill
     chunks; when blocks run out the lowest-ranked running sequence is preempted (maybe the one
     asking);
  2. (admission.py) waiting requests, best effective priority first, within the step's token
     budget and max_num_seqs, preempting a lower-priority running sequence if the batch is full;
  3. (admission.py) lower-priority prefill chunks that pass 1 held back for a higher-priority
     prefill, only if no such prefill ended up in the step (`isolate_priority_prefill`).
While higher-priority requests keep arriving, lower-priority prefill is held to a share of each
step (`lower_priority_prefill_tokens`). The step is written into a StepBuilder (builder.py);
its result is applied by results.py. The books all passes share are in state.py.
"""

from __future__ import annotations

from services.protocol import StepPlan, StepResult
from services.scheduler import admission, results, running
from services.scheduler.builder import StepBuilder
from services.scheduler.errors import InvalidRequest, QueueFull
from services.scheduler.events import Event, Queued
from services.scheduler.request import Request, RequestState, Status
from services.scheduler.state import Flight, SchedulerState

# Weight of the newest step duration in the moving average used to judge deadlines.
_STEP_ALPHA = 0.2


class Scheduler(SchedulerState):
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise InvalidRequest (bad field) or QueueFull (backpressure)."""
        if request.seq_id in self.requests:
            raise InvalidRequest("seq_id", f"{request.seq_id} is already in flight")
        admission.validate(request, self.config)
        cfg, waiting = self.config, self.waiting
        if waiting.count >= cfg.max_queued_requests:
            raise QueueFull(f"{waiting.count} requests already waiting")
        if waiting.num_tokens + len(request.prompt_token_ids) > cfg.max_queued_tokens:
            raise QueueFull(
                f"{waiting.num_tokens} prompt tokens already waiting: "
                f"{len(request.prompt_token_ids)} more would pass max_queued_tokens="
                f"{cfg.max_queued_tokens}"
            )
        now = self.clock()
        arrival = now if request.arrival_time is None else request.arrival_time
        order = next(self._orders)
        req = RequestState(request, arrival, order, cfg.block_size, cfg.enable_prefix_caching)
        self.requests[req.seq_id] = req
        waiting.push(req)
        self.deadlines.add(req)
        self.window.on_arrival(now)
        self.traffic.on_arrival(req.priority, now)
        self.events.append(Queued(req.seq_id, now, waiting.count))

    def cancel(self, seq_id: int) -> bool:
        """Finish a request as cancelled and free its blocks now; False if it is not known."""
        req = self.requests.get(seq_id)
        if req is None:
            return False
        self.finish(req, "cancelled", self.clock())
        return True

    def schedule(self) -> StepPlan:
        """The next step's batch. A non-empty plan must be answered by `update`; with
        `async_scheduling` the next call may come before that answer (one more plan in flight),
        otherwise it must come after. An empty plan needs no answer (its finished ids wait for
        the next plan)."""
        if len(self.flights) >= self.max_flights:
            raise RuntimeError(
                f"schedule() called while {len(self.flights)} plan(s) await update()"
            )
        now = self.clock()
        self.preempted_now.clear()
        self._expire(now)
        cfg = self.config
        top = self.traffic.top(now) if cfg.lower_priority_prefill_tokens else None
        budget = cfg.step_tokens(self.waiting.num_tokens)
        builder = StepBuilder(
            budget,
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
        if budget > cfg.max_num_batched_tokens:
            self.num_backlog_steps += 1
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
        ewma = self.step_s_ewma
        self.step_s_ewma = step_s if ewma == 0.0 else ewma + _STEP_ALPHA * (step_s - ewma)
        if results.apply(self, plan, flight.reqs, result, now):
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return self.drain_events()

    @property
    def num_in_flight(self) -> int:
        return len(self.flights)

    def _expire(self, now: float) -> None:
        # A waiting request whose deadline falls within one step cannot produce a token in time.
        for req in self.deadlines.waiting.pop_until(now + self.step_s_ewma):
            self.finish(req, "deadline", now, "could not start before the deadline")
        for req in self.deadlines.running.pop_until(now):
            self.finish(req, "deadline", now, "the deadline passed while it ran")

    # -- for the service loop ----------------------------------------------------------------

    def next_wakeup(self) -> float | None:
        """Clock time at which `schedule()` has something to do even if nothing arrives (a batch
        window closes, a deadline passes); None if only an arrival or a result can change
        anything. The service loop sleeps until then instead of polling."""
        times = [self.deadlines.running.earliest()]
        if self.waiting.count and not self.running:
            times.append(self.window.closes_at)
        waiting_deadline = self.deadlines.waiting.earliest()
        if waiting_deadline is not None:
            times.append(waiting_deadline - self.step_s_ewma)
        return min((t for t in times if t is not None), default=None)
