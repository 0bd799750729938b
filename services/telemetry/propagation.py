"""W3C trace context as it travels in records and metadata, and the clocks spans are stamped with.

gRPC calls carry `traceparent` in metadata (the instrumentation's interceptors, or `extract` on
the public edge); the hot-path records carry the same string in their `traceparent` fields.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_W3C = TraceContextTextMapPropagator()
_ROOT = Context()


def traceparent_of(ctx: SpanContext) -> str:
    """The W3C `traceparent` header of a span context; empty for an invalid one."""
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def context_of(traceparent: str) -> Context | None:
    """The context to start a child span in, from a `traceparent`; None if empty or malformed."""
    return _extract({"traceparent": traceparent}) if traceparent else None


def span_context_of(traceparent: str) -> SpanContext | None:
    ctx = context_of(traceparent)
    return None if ctx is None else trace.get_current_span(ctx).get_span_context()


def current_traceparent() -> str:
    """The `traceparent` of the current span (e.g. a traced RPC's server span); empty if none."""
    return traceparent_of(trace.get_current_span().get_span_context())


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """A caller's trace context from gRPC metadata (`traceparent`, `tracestate`), if it sent one."""
    carrier = {
        k: v.decode() if isinstance(v, bytes) else v
        for k, v in metadata or ()
        if k in ("traceparent", "tracestate")
    }
    return _extract(carrier) if "traceparent" in carrier else None


def _extract(carrier: dict[str, str]) -> Context | None:
    ctx = _W3C.extract(carrier, _ROOT)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


class EpochClock:
    """Span timestamps (ns since the epoch) for times read from `time.monotonic()`.

    The scheduler's decisions carry monotonic times; the offset is taken once, so intervals keep
    the monotonic clock's precision and are never bent by a wall-clock step.
    """

    def __init__(
        self,
        wall_ns: Callable[[], int] = time.time_ns,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.monotonic_ns = monotonic_ns
        self.offset_ns = wall_ns() - monotonic_ns()

    def ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self.offset_ns

    def now_ns(self) -> int:
        return self.monotonic_ns() + self.offset_ns
