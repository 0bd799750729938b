"""The worker's telemetry: one `step` span and one set of metric observations per step.

The span's parent is the request phase span the scheduler named in StepDescriptor.traceparent
(so a request running alone has all its steps in its own trace), and it links to the request
span of every (sampled) sequence in the batch: the link is made once per sequence, from
NewSequence.traceparent, and reused for every step it runs in. Runs on the thread that runs the
step (the ring thread, or a gRPC Step call's worker thread), after the step's outcome is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.trace import Link, Status, StatusCode

from services.telemetry.propagation import context_of, span_context_of
from services.telemetry.tracing import Tracing
from services.worker.metrics import WorkerMetrics
from tandem.internal.v1 import hotpath_pb2 as hp

_ROOT = Context()


class WorkerTelemetry:
    def __init__(self, tracing: Tracing | None = None, metrics: WorkerMetrics | None = None):
        tracing = tracing or Tracing.off()
        self.tracer, self.tracing_on = tracing.tracer, tracing.enabled
        self.metrics = metrics or WorkerMetrics("")
        self.links: dict[int, Link] = {}
        self.pending: list[_Step] = []
        self._parent = ""
        self._parent_ctx: Context = _ROOT

    def reset(self) -> None:
        """A new scheduler attached: its sequence ids start over."""
        self.links.clear()

    def record(
        self,
        desc: hp.StepDescriptor,
        outcome: hp.StepOutcome | None,
        start_ns: int,
        duration_s: float,
        error: BaseException | None = None,
        launch_s: float | None = None,
    ) -> None:
        """Note a step that ran; nothing is made until `flush`."""
        self.pending.append(_Step(desc, outcome, start_ns, duration_s, error, launch_s))

    def flush(self) -> None:
        """Make the spans and observations of the steps recorded since the last flush. Called
        once the step's outcome is on its way, so that the (per-link) span work overlaps the
        scheduler's planning of the next step instead of delaying its outcome."""
        pending, self.pending = self.pending, []
        for step in pending:
            self._observe(step)
            if self.tracing_on:
                self._span(step)

    def _observe(self, step: _Step) -> None:
        m, desc = self.metrics, step.desc
        m.step_duration.observe(step.duration_s)
        if step.launch_s is not None:
            launch = m.launch_prefill if desc.num_prefill_tokens else m.launch_decode
            launch.observe(step.launch_s)
        m.batch_size.observe(len(desc.seq_ids))
        m.iteration_tokens.observe(desc.num_prefill_tokens + desc.num_decode_tokens)
        m.prefill_tokens.inc(desc.num_prefill_tokens)
        m.decode_tokens.inc(desc.num_decode_tokens)
        if step.error is not None or (step.outcome is not None and step.outcome.error):
            m.failures.inc()

    def _span(self, step: _Step) -> None:
        desc, outcome, error = step.desc, step.outcome, step.error
        links = self.links
        for seq_id in desc.finished_seq_ids:
            links.pop(seq_id, None)
        for new in desc.new_seqs:
            ctx = span_context_of(new.traceparent)
            # A request that is not sampled has no span to link to in any backend.
            if ctx is not None and ctx.trace_flags.sampled:
                links[new.seq_id] = Link(ctx)
        if desc.traceparent != self._parent:
            # Consecutive decode steps usually share a parent: parse it once.
            self._parent = desc.traceparent
            self._parent_ctx = context_of(desc.traceparent) or _ROOT
        span = self.tracer.start_span(
            "step",
            context=self._parent_ctx,
            links=[links[s] for s in desc.seq_ids if s in links],
            start_time=step.start_ns,
            attributes={
                "tandem.step.id": desc.step_id,
                "tandem.step.batch_size": len(desc.seq_ids),
                "tandem.step.prefill_tokens": desc.num_prefill_tokens,
                "tandem.step.decode_tokens": desc.num_decode_tokens,
                "tandem.step.new_sequences": len(desc.new_seqs),
                "tandem.kv.blocks_in_use": desc.kv_blocks_used,
                "tandem.kv.blocks_in_step": sum(desc.block_counts),
            },
        )
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        elif outcome is not None:
            span.set_attribute("tandem.step.sampled", len(outcome.seq_ids))
            if outcome.error:
                span.set_attribute("tandem.step.failed_sequences", len(outcome.failed_seq_ids))
                span.set_status(Status(StatusCode.ERROR, outcome.error))
        span.end(step.start_ns + int(step.duration_s * 1e9))


@dataclass(frozen=True, slots=True)
class _Step:
    desc: hp.StepDescriptor
    outcome: hp.StepOutcome | None
    start_ns: int  # since the epoch
    duration_s: float
    error: BaseException | None
    launch_s: float | None  # None: the launch failed
