"""The scheduler's telemetry: its core's decisions (events.py) as request spans and metrics.

For each request, in the trace the tokenizer named in SubmitRequest.traceparent:

    queue    Queued → Scheduled                  time in queue, queue depth, cached prompt tokens
    prefill  Scheduled → first token             chunks of it may span several steps
    decode   first token → Finished              preemptions are events on the phase span, and
                                                 the wait to resume is another `queue` span

Spans are stamped with the scheduler's own (monotonic) decision times. Each step record carries,
in StepDescriptor.traceparent, the phase span of the first sampled request it runs: the worker's
`step` span is its child, and links to every request it served.

Everything here runs on the scheduler's event loop, a few dictionary operations per request
decision; with tracing off only the metrics' part runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from services.protocol import StepPlan
from services.scheduler.events import (
    Event,
    Finished,
    Preempted,
    Queued,
    Resumed,
    Scheduled,
    Token,
)
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.state import SchedulerStats
from services.telemetry.propagation import EpochClock, context_of, traceparent_of
from services.telemetry.tracing import Tracing
from tandem.internal.v1 import hotpath_pb2 as hp

# Finish reasons that are the server's failure (cancelled is the client's choice; stop and
# length are successes).
_ERRORS = ("error", "deadline")


@dataclass(slots=True)
class _Request:
    parent: Context | None
    attributes: dict[str, str | int]
    phase: Span | None = None
    # `traceparent` of the phase span, what a step record names as its parent.
    phase_parent: str = ""
    sampled: bool = False
    # The open `queue` span: first arrival, or the wait after a preemption.
    waiting: Span | None = None
    scheduled_t: float = 0.0
    first_token_t: float = 0.0


class SchedulerTelemetry:
    def __init__(self, tracing: Tracing | None = None, metrics: SchedulerMetrics | None = None):
        tracing = tracing or Tracing.off()
        self.tracer, self.tracing_on = tracing.tracer, tracing.enabled
        self.metrics = metrics or SchedulerMetrics()
        self.clock = EpochClock()
        self.requests: dict[int, _Request] = {}

    def on_model(self, model_name: str) -> None:
        self.metrics.set_model(model_name)

    def on_submit(
        self,
        seq_id: int,
        request_id: str,
        traceparent: str,
        *,
        prompt_tokens: int,
        max_tokens: int,
        priority: int,
        session_id: str,
    ) -> None:
        """A request the core accepted; its Queued event follows."""
        attributes: dict[str, str | int] = {
            "tandem.request_id": request_id,
            "tandem.priority": priority,
            "gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.request.max_tokens": max_tokens,
        }
        if session_id:
            attributes["tandem.session_id"] = session_id
        self.requests[seq_id] = _Request(context_of(traceparent), attributes)

    def on_events(self, events: Sequence[Event]) -> None:
        now = time.monotonic()  # Token events carry no time: they are this update's
        for event in events:
            if type(event) is Token:
                if event.index == 0:
                    self._first_token(event.seq_id, now)
                continue
            req = self.requests.get(event.seq_id)
            if req is None:
                continue
            if type(event) is Queued:
                req.waiting = self._start("queue", req, event.time)
                if req.waiting is not None:
                    req.waiting.set_attribute("tandem.queue_depth", event.queue_depth)
            elif type(event) is Scheduled:
                self.metrics.queue_time.observe(event.queue_s)
                req.scheduled_t = event.time
                if req.waiting is not None:
                    req.waiting.set_attributes(
                        {
                            "tandem.queue_s": event.queue_s,
                            "tandem.cached_prompt_tokens": event.num_cached_tokens,
                        }
                    )
                    req.waiting.end(self.clock.ns(event.time))
                    req.waiting = None
                self._phase("prefill", req, event.time)
            elif type(event) is Preempted:
                if req.phase is not None:
                    req.phase.add_event(
                        "preempted",
                        {
                            "tandem.cause": event.cause,
                            "tandem.computed_tokens": event.num_computed_tokens,
                        },
                        self.clock.ns(event.time),
                    )
                req.waiting = self._start("queue", req, event.time)
                if req.waiting is not None:
                    req.waiting.set_attributes(
                        {"tandem.preempted": True, "tandem.cause": event.cause}
                    )
            elif type(event) is Resumed:
                if req.waiting is not None:
                    req.waiting.set_attribute("tandem.cached_tokens", event.num_cached_tokens)
                    req.waiting.end(self.clock.ns(event.time))
                    req.waiting = None
            elif type(event) is Finished:
                self._finish(req, event, now)

    def _first_token(self, seq_id: int, now: float) -> None:
        req = self.requests.get(seq_id)
        if req is None or req.first_token_t:
            return
        req.first_token_t = now
        if req.scheduled_t:
            self.metrics.prefill_time.observe(now - req.scheduled_t)
        self._phase("decode", req, now)

    def _finish(self, req: _Request, event: Finished, now: float) -> None:
        del self.requests[event.seq_id]
        end = max(event.time, req.first_token_t)
        m = self.metrics
        if req.first_token_t:
            m.decode_time.observe(end - req.first_token_t)
        if req.scheduled_t:
            m.inference_time.observe(end - req.scheduled_t)
        end_ns = self.clock.ns(end)
        for span in (req.waiting, req.phase):
            if span is None:
                continue
            span.set_attributes(
                {
                    "tandem.finish_reason": event.reason,
                    "gen_ai.usage.output_tokens": event.num_output_tokens,
                }
            )
            if event.reason in _ERRORS:
                span.set_status(Status(StatusCode.ERROR, event.message or event.reason))
            span.end(end_ns)

    def _start(self, name: str, req: _Request, t: float) -> Span | None:
        if not self.tracing_on:
            return None
        return self.tracer.start_span(
            name,
            context=req.parent,
            attributes=req.attributes,
            start_time=self.clock.ns(t),
        )

    def _phase(self, name: str, req: _Request, t: float) -> None:
        if req.phase is not None:
            req.phase.end(self.clock.ns(t))
        req.phase = self._start(name, req, t)
        if req.phase is not None:
            ctx = req.phase.get_span_context()
            req.phase_parent = traceparent_of(ctx)
            req.sampled = ctx.trace_flags.sampled

    def on_stats(self, stats: SchedulerStats) -> None:
        self.metrics.observe_stats(stats)

    def on_plan(self, plan: StepPlan, desc: hp.StepDescriptor, stats: SchedulerStats) -> None:
        """Fill the step record's telemetry fields before it is sent (encode_plan wrote the
        plan's own)."""
        desc.kv_blocks_used = stats.kv_blocks_used
        if not self.tracing_on:
            return
        # The first sampled request parents the step; with none sampled, an unsampled parent
        # tells the worker's (parent-based) sampler to drop the step span too.
        requests = self.requests
        fallback = ""
        for seq_id in plan.seq_ids:
            req = requests.get(seq_id)
            if req is None or not req.phase_parent:
                continue
            if req.sampled:
                desc.traceparent = req.phase_parent
                return
            fallback = fallback or req.phase_parent
        desc.traceparent = fallback

    def on_hops(self, to_worker_s: float | None, to_scheduler_s: float | None) -> None:
        """A step's hop times, as the worker link measured them (None: not measurable)."""
        if to_worker_s is not None:
            self.metrics.hop_to_worker.observe(to_worker_s)
        if to_scheduler_s is not None:
            self.metrics.hop_to_scheduler.observe(to_scheduler_s)
