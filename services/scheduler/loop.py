"""The scheduler's event-driven loop: the pure core, wired to the worker and the tokenizers.

Nothing polls. The loop wakes on an arrival or a cancellation (the RPC handlers set `wake`), on
a step's outcome (the receiver task), and at the core's `next_wakeup()` (a batch window closing,
a deadline passing), armed as a timer. With async scheduling two plans are in flight: while the
worker runs step N, step N+1 is already planned and waiting on its ring, its decode tokens left
as placeholders the worker fills with what it sampled in step N — so the hop and the
scheduler's own time hide behind the step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable

from services.scheduler.codec import RequestRecord, TopLogprobs, decode_outcome, encode_plan
from services.scheduler.config import SchedulerConfig
from services.scheduler.events import Event, Finished, Scheduled, Token
from services.scheduler.plan import StepPlan
from services.scheduler.policy import Scheduler
from services.scheduler.request import Request
from services.scheduler.routes import Routes
from services.scheduler.worker_link import WorkerGone, WorkerLink
from services.telemetry.scheduler_telemetry import SchedulerTelemetry
from tandem.internal.v1 import hotpath_pb2 as hp

log = logging.getLogger(__name__)

WORKER_GONE = "UNAVAILABLE: the worker died; the request was lost"


class StepLoop:
    def __init__(
        self,
        link: WorkerLink,
        routes: Routes,
        make_config: Callable[[hp.ModelDescription], SchedulerConfig],
        telemetry: SchedulerTelemetry | None = None,
    ) -> None:
        self.link = link
        self.routes = routes
        self.make_config = make_config
        self.telemetry = telemetry or SchedulerTelemetry()
        self.core: Scheduler | None = None
        self.model: hp.ModelDescription | None = None
        self.records: dict[str, RequestRecord] = {}
        self.by_seq: dict[int, RequestRecord] = {}
        # Finished requests the worker still knows: dropped once a plan tells it to forget them.
        self.finishing: list[RequestRecord] = []
        self.in_flight: deque[StepPlan] = deque()
        self.wake = asyncio.Event()
        self.timer: asyncio.TimerHandle | None = None
        self.worker_restarts = 0
        self.ready = asyncio.Event()
        self._seq_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self._connect()
        self._tasks = [
            asyncio.create_task(self._plan_loop()),
            asyncio.create_task(self._receive_loop()),
        ]

    async def _connect(self) -> None:
        self.ready.clear()
        self.model = await self.link.connect()
        # A new worker has an empty KV cache: the accounts start over.
        self.core = Scheduler(self.make_config(self.model))
        self.telemetry.on_model(self.model.name)
        self.ready.set()
        log.info(
            "worker ready: %s, %d KV blocks of %d",
            self.model.name,
            self.model.num_kv_blocks,
            self.model.block_size,
        )
        self.wake.set()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.link.close()
        self.routes.close()

    # -- what the RPCs call ------------------------------------------------------------------

    def submit(self, record: RequestRecord, request: Request) -> None:
        if self.core is None or not self.ready.is_set():
            from services.errors import Unavailable

            raise Unavailable("the worker is (re)starting; try again shortly")
        self.core.add_request(request)  # raises QueueFull / InvalidRequest
        self.telemetry.on_submit(
            record.request_id,
            record.traceparent,
            prompt_tokens=record.prompt_len,
            max_tokens=request.max_tokens,
            priority=request.priority,
            session_id=request.session_id or "",
        )
        self.records[record.request_id] = record
        self.by_seq[record.seq_id] = record
        self.wake.set()

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def cancel(self, request_id: str) -> bool:
        found = self.core is not None and self.core.cancel(request_id)
        if found:
            self.wake.set()
        return found

    def cancel_tokenizer(self, tokenizer_id: str) -> None:
        for record in [r for r in self.records.values() if r.tokenizer_id == tokenizer_id]:
            self.cancel(record.request_id)

    # -- the two tasks -----------------------------------------------------------------------

    async def _plan_loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            core = self.core
            if core is None or not self.ready.is_set():
                continue
            limit = 2 if core.config.async_scheduling else 1
            while len(self.in_flight) < limit and self._plan_one(core):
                pass
            self._arm_timer(core.next_wakeup())

    def _plan_one(self, core: Scheduler) -> bool:
        """Plan and send one step; False when there is nothing to run."""
        plan = core.schedule()
        self._route(core.drain_events())
        stats = core.stats()
        self.telemetry.on_stats(stats)
        if plan.is_empty:
            return False
        desc = encode_plan(plan, self.records, self.finishing)
        self.telemetry.on_plan(plan, desc, stats)
        self._forget_finished()
        self.in_flight.append(plan)
        try:
            self.link.send(desc)
        except WorkerGone as err:
            log.error("%s", err)  # the receiver finds the worker gone too
            return False
        return True

    async def _receive_loop(self) -> None:
        while True:
            try:
                outcome = await self.link.receive()
            except WorkerGone as err:
                await self._worker_lost(str(err))
                continue
            core = self.core
            plan = self.in_flight[0] if self.in_flight else None
            if core is None or plan is None or outcome.step_id != plan.step_id:
                log.warning(
                    "dropping the outcome of step %d: no such step in flight", outcome.step_id
                )
                continue
            if outcome.error:
                log.warning("step %d: %s", outcome.step_id, outcome.error)
            self.telemetry.on_outcome(self.link.sent_ns, outcome)
            result, top = decode_outcome(outcome, self.by_seq)
            self.in_flight.popleft()
            self._route(core.update(plan, result), top, outcome.step_id)
            self.wake.set()

    async def _worker_lost(self, why: str) -> None:
        log.error("worker lost (%s); failing in-flight requests and waiting for it to return", why)
        self.ready.clear()
        self.in_flight.clear()
        if self.core is not None:
            events = self.core.fail_all(WORKER_GONE)
            self._route(events)
        self.records.clear()
        self.by_seq.clear()
        self.finishing.clear()
        self.worker_restarts += 1
        await self._connect()

    # -- events to tokenizers ------------------------------------------------------------

    def _route(self, events: list[Event], top: TopLogprobs | None = None, step_id: int = 0) -> None:
        if not events:
            return
        self.telemetry.on_events(events)
        batches: dict[str, hp.EventBatch] = {}
        entries: dict[str, hp.RequestEvents] = {}

        def entry(request_id: str) -> hp.RequestEvents | None:
            if request_id in entries:
                return entries[request_id]
            record = self.records.get(request_id)
            if record is None:
                return None
            batch = batches.get(record.tokenizer_id)
            if batch is None:
                batch = batches[record.tokenizer_id] = hp.EventBatch(step_id=step_id)
            e = entries[request_id] = batch.requests.add(request_id=request_id)
            return e

        for event in events:
            if isinstance(event, Token):
                e = entry(event.request_id)
                if e is None:
                    continue
                e.token_ids.append(event.token_id)
                e.logprobs.append(event.logprob)
                self.records[event.request_id].output_ids.append(event.token_id)
                if top is not None and event.request_id in top:
                    for token_id, logprob in top[event.request_id]:
                        e.top_ids.append(token_id)
                        e.top_logprobs.append(logprob)
            elif isinstance(event, Finished):
                e = entry(event.request_id)
                if e is not None:
                    e.finish_reason = event.reason
                    e.error = event.message
                    self._finish_record(event.request_id)
            elif isinstance(event, Scheduled):
                e = entry(event.request_id)
                if e is not None:
                    e.cached_prompt_tokens = event.num_cached_tokens
                    e.queue_s = event.queue_s
        if self.core is not None:
            stats = self.core.stats()
            for batch in batches.values():
                batch.waiting, batch.running = stats.num_waiting, stats.num_running
        for tokenizer_id in self.routes.publish(batches):
            self.cancel_tokenizer(tokenizer_id)

    def _finish_record(self, request_id: str) -> None:
        record = self.records.pop(request_id)
        if record.known_to_worker:
            self.finishing.append(record)  # encode_plan still needs its seq id
        else:
            self.by_seq.pop(record.seq_id, None)

    def _forget_finished(self) -> None:
        still = []
        for record in self.finishing:
            if record.known_to_worker:
                still.append(record)
            else:
                self.by_seq.pop(record.seq_id, None)
        self.finishing = still

    def _arm_timer(self, when: float | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if when is not None:
            self.timer = asyncio.get_running_loop().call_at(when, self.wake.set)
