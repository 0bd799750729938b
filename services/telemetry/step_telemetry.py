"""The worker's telemetry: one `step` span and one set of metric observations per step.

The span's parent is the request phase span the scheduler named in StepDescriptor.traceparent
(so a request running alone has all its steps in its own trace), and it links to the request
span of every sequence in the batch: the link is made once per sequence, from
NewSequence.traceparent, and reused for every step it runs in. Runs on the thread that runs the
step (the ring thread, or a gRPC Step call's worker thread).
"""

from __future__ import annotations

import time

from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, Status, StatusCode

from services.telemetry.propagation import context_of, span_context_of
from services.telemetry.tracing import Tracing
from services.telemetry.worker_metrics import WorkerMetrics
from tandem.internal.v1 import hotpath_pb2 as hp

_ROOT = Context()


class StepTelemetry:
    def __init__(self, tracing: Tracing | None = None, metrics: WorkerMetrics | None = None):
        self.tracing = tracing or Tracing.off()
        self.tracer = self.tracing.tracer
        self.tracing_on = self.tracing.enabled
        self.metrics = metrics or WorkerMetrics("")
        self.links: dict[int, Link] = {}
        self._parent = ""
        self._parent_ctx: Context = _ROOT

    def reset(self) -> None:
        """A new scheduler attached: its sequence ids start over."""
        self.links.clear()

    def begin(self, desc: hp.StepDescriptor) -> tuple[float, Span | None]:
        started = time.perf_counter()
        if not self.tracing_on:
            return started, None
        links = self.links
        for seq_id in desc.finished_seq_ids:
            links.pop(seq_id, None)
        for new in desc.new_seqs:
            ctx = span_context_of(new.traceparent)
            if ctx is not None:
                links[new.seq_id] = Link(ctx)
        if desc.traceparent != self._parent:
            # Consecutive decode steps usually share a parent: parse it once.
            self._parent = desc.traceparent
            self._parent_ctx = context_of(desc.traceparent) or _ROOT
        span = self.tracer.start_span(
            "step",
            context=self._parent_ctx,
            links=[links[s] for s in desc.seq_ids if s in links],
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
        return started, span

    def end(
        self,
        started: float,
        span: Span | None,
        desc: hp.StepDescriptor,
        outcome: hp.StepOutcome | None,
        error: BaseException | None = None,
    ) -> None:
        m = self.metrics
        m.step_duration.observe(time.perf_counter() - started)
        m.batch_size.observe(len(desc.seq_ids))
        m.iteration_tokens.observe(desc.num_prefill_tokens + desc.num_decode_tokens)
        m.prefill_tokens.inc(desc.num_prefill_tokens)
        m.decode_tokens.inc(desc.num_decode_tokens)
        failed = error is not None or (outcome is not None and bool(outcome.error))
        if failed:
            m.failures.inc()
        if span is None:
            return
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        elif outcome is not None:
            span.set_attribute("tandem.step.sampled", len(outcome.seq_ids))
            if outcome.error:
                span.set_attribute("tandem.step.failed_sequences", len(outcome.failed_seq_ids))
                span.set_status(Status(StatusCode.ERROR, outcome.error))
        span.end()
