"""The scheduler's event-driven loop: the pure core, wired to the worker and the tokenizers.

Nothing polls. The loop wakes on an arrival or a cancellation (the RPC handlers set `wake`), on
a step's outcome (the receiver task), and at the core's `next_wakeup()` (a batch window closing,
a deadline passing), armed as a timer. With async scheduling it keeps two plans in flight, so
the hop and the scheduler's own time hide behind the step (see services/protocol.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.errors import CannotStart, InvalidArgument, ResourceExhausted, Unavailable
from services.protocol import SequenceRecord, TopLogprobs, decode_outcome, encode_plan
from services.scheduler.config import SchedulerConfig
from services.scheduler.errors import InvalidRequest, QueueFull
from services.scheduler.events import Event, Finished, Scheduled, Token
from services.scheduler.request import Request
from services.scheduler.routes import Routes
from services.scheduler.scheduler import Scheduler
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.worker_link import WorkerGone, WorkerLink
from tandem.internal.v1 import hotpath_pb2 as hp

log = logging.getLogger(__name__)
# Between failed attempts to attach the worker (each waits for it on its own first).
RECONNECT_PAUSE_S = 0.5


@dataclass
class RequestRecord(SequenceRecord):
    """A request as the service knows it beside the core: whose it is, and what the worker is
    told about it."""

    request_id: str = ""
    tokenizer_id: str = ""


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
        # By sequence id, and the client's request id to it (cancellation names the request).
        self.records: dict[int, RequestRecord] = {}
        self.seq_ids: dict[str, int] = {}
        self.wake = asyncio.Event()
        self.timer: asyncio.TimerHandle | None = None
        self.worker_restarts = 0
        # When and why the worker was last lost; None before it was ever lost.
        self.lost: tuple[float, str] | None = None
        self.ready = asyncio.Event()
        self._seq_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Attach the worker; CannotStart if this policy cannot schedule the model it serves."""
        await self._reconnect(first=True)
        self._tasks = [
            asyncio.create_task(self._plan_loop()),
            asyncio.create_task(self._receive_loop()),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.link.close()
        self.routes.close()

    # -- what the RPCs call ------------------------------------------------------------------

    def submit(self, record: RequestRecord, request: Request) -> None:
        if self.core is None or not self.ready.is_set():
            raise Unavailable(self.worker_down())
        if record.request_id in self.seq_ids:
            raise InvalidArgument("request_id", f"{record.request_id!r} is already in flight")
        try:
            self.core.add_request(request)
        except InvalidRequest as err:
            raise InvalidArgument(err.field, str(err).split(": ", 1)[1]) from None
        except QueueFull as err:
            raise ResourceExhausted(str(err)) from None
        self.telemetry.on_submit(
            record.seq_id,
            record.request_id,
            record.traceparent,
            prompt_tokens=record.prompt_len,
            max_tokens=request.max_tokens,
            priority=request.priority,
            session_id=request.session_id or "",
        )
        self.records[record.seq_id] = record
        self.seq_ids[record.request_id] = record.seq_id
        self.wake.set()

    def worker_down(self) -> str:
        """What is true while there is no worker: since when, why, and where it is awaited."""
        where = f"waiting for it at {self.link.address}"
        if self.lost is None:
            return f"no worker yet: {where}"
        lost_at, why = self.lost
        return f"the worker is down: lost {time.monotonic() - lost_at:.0f} s ago ({why}); {where}"

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def cancel(self, request_id: str) -> bool:
        seq_id = self.seq_ids.get(request_id)
        found = seq_id is not None and self.core is not None and self.core.cancel(seq_id)
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
            while core.num_in_flight < core.max_flights and self._plan_one(core):
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
        desc = encode_plan(plan, self.records)
        self.telemetry.on_plan(plan, desc, stats)
        try:
            self.link.send(desc)
        except WorkerGone as err:
            log.error("%s", err)
            # A step that never left is never answered: closing the rings ends the receiver's
            # wait, and it attaches the worker afresh.
            self.link.abandon(str(err))
            return False
        return True

    async def _receive_loop(self) -> None:
        while True:
            try:
                self._apply(await self.link.receive())
            except WorkerGone as err:
                await self._worker_lost(str(err))

    def _apply(self, outcome: hp.StepOutcome) -> None:
        core = self.core
        plan = core.flights[0].plan if core is not None and core.flights else None
        if core is None or plan is None or outcome.step_id != plan.step_id:
            # The worker answers the steps in flight in order: anything else means the link
            # is corrupt, and the step really in flight may never be answered.
            expected = plan.step_id if plan is not None else "none"
            raise WorkerGone(f"an outcome of step {outcome.step_id}, step in flight: {expected}")
        if outcome.error:
            log.warning("step %d: %s", outcome.step_id, outcome.error)
        self.telemetry.on_hops(*self.link.last_hops)
        try:
            result, top = decode_outcome(outcome)
        except ValueError as err:
            raise WorkerGone(f"step {outcome.step_id}: {err}") from err
        self._route(core.update(plan, result), top, outcome.step_id, outcome.prompt_logprobs)
        self.wake.set()

    async def _worker_lost(self, why: str) -> None:
        log.error("worker lost (%s); failing in-flight requests and waiting for it to return", why)
        self.ready.clear()
        self.lost = (time.monotonic(), why)
        if self.core is not None:
            self._route(
                self.core.fail_all(f"UNAVAILABLE: lost the worker ({why}); the request was lost")
            )
        self.records.clear()
        self.seq_ids.clear()
        self.worker_restarts += 1
        await self._reconnect()

    async def _reconnect(self, first: bool = False) -> None:
        """Attach the worker again, however many attempts it takes: an exception that left this
        task would leave the scheduler without a worker for good, and say nothing. Only the
        first attach, at start, gives up: on a worker whose model the policy cannot schedule."""
        said = ""
        while True:
            try:
                self.ready.clear()
                self.model = await self.link.connect()
                # A new worker has an empty KV cache: the accounts start over.
                self.core = Scheduler(self._config(self.model))
                self.telemetry.on_model(self.model.name)
                self.ready.set()
                log.info(
                    "worker ready: %s, %d KV blocks of %d",
                    self.model.name,
                    self.model.num_kv_blocks,
                    self.model.block_size,
                )
                self.wake.set()
                return
            except WorkerGone as err:
                log.warning("no worker attached at %s (%s); trying again", self.link.address, err)
            except CannotStart as err:
                if first:
                    raise  # the service's stop closes the link
                if str(err) != said:  # once, not every attempt
                    log.error("%s; waiting for a worker it can", err)
                    said = str(err)
            except Exception:
                log.exception("attaching the worker at %s failed; trying again", self.link.address)
            await self.link.reopen()
            await asyncio.sleep(RECONNECT_PAUSE_S)

    def _config(self, model: hp.ModelDescription) -> SchedulerConfig:
        try:
            return self.make_config(model)
        except ValueError as err:
            raise CannotStart(
                f"the worker at {self.link.address} serves {model.name} (contexts of up to "
                f"{model.max_seq_len} tokens, {model.num_kv_blocks} KV blocks of "
                f"{model.block_size}), which the scheduling policy cannot: {err}"
            ) from None

    # -- events to tokenizers ------------------------------------------------------------

    def _route(
        self,
        events: list[Event],
        top: TopLogprobs | None = None,
        step_id: int = 0,
        prompts: Sequence[hp.PromptLogprobs] = (),
    ) -> None:
        """prompts: the step's scored prompt tokens, which go with the events of their requests
        (before any that finishes a request)."""
        if not events and not prompts:
            return
        self.telemetry.on_events(events)
        batches: dict[str, hp.EventBatch] = {}
        entries: dict[int, hp.RequestEvents] = {}

        def entry(seq_id: int, record: RequestRecord) -> hp.RequestEvents:
            e = entries.get(seq_id)
            if e is None:
                batch = batches.get(record.tokenizer_id)
                if batch is None:
                    batch = batches[record.tokenizer_id] = hp.EventBatch(step_id=step_id)
                e = entries[seq_id] = batch.requests.add(request_id=record.request_id)
            return e

        for scores in prompts:
            record = self.records.get(scores.seq_id)
            if record is not None:
                e = entry(scores.seq_id, record)
                e.prompt_logprobs.CopyFrom(scores)
                e.prompt_logprobs.ClearField("seq_id")
        for event in events:
            record = self.records.get(event.seq_id)
            if record is None or not isinstance(event, Token | Finished | Scheduled):
                continue
            e = entry(event.seq_id, record)
            if isinstance(event, Token):
                e.token_ids.append(event.token_id)
                e.logprobs.append(event.logprob)
                record.output_ids.append(event.token_id)
                if top is not None and event.seq_id in top:
                    for token_id, logprob in top[event.seq_id]:
                        e.top_ids.append(token_id)
                        e.top_logprobs.append(logprob)
            elif isinstance(event, Finished):
                e.finish_reason = event.reason
                e.error = event.message
                del self.records[event.seq_id]
                self.seq_ids.pop(record.request_id, None)
            else:
                e.cached_prompt_tokens = event.num_cached_tokens
                e.queue_s = event.queue_s
        if self.core is not None:
            stats = self.core.stats()
            for batch in batches.values():
                batch.waiting, batch.running = stats.num_waiting, stats.num_running
        for tokenizer_id in self.routes.publish(batches):
            self.cancel_tokenizer(tokenizer_id)

    def _arm_timer(self, when: float | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if when is not None:
            self.timer = asyncio.get_running_loop().call_at(when, self.wake.set)
