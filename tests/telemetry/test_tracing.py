"""Tracing setup: samplers by name, export through the batch processor, flush on shutdown."""

from __future__ import annotations

import pytest

from services.telemetry.config import SAMPLERS, TelemetryConfig, TracingSettings
from services.telemetry.propagation import (
    EpochClock,
    context_from_metadata,
    context_of,
    span_context_of,
    traceparent_of,
)
from services.telemetry.tracing import Tracing, make_sampler
from tests.telemetry.conftest import Recorded

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("name", SAMPLERS)
def test_every_sampler_name_makes_that_sampler(name: str) -> None:
    description = make_sampler(name, 0.5).get_description()
    root = "AlwaysOffSampler" if name.endswith("always_off") else "AlwaysOnSampler"
    if name.endswith("traceidratio"):
        root = "TraceIdRatioBased{0.5}"
    assert description.startswith(f"ParentBased{{root:{root}") == name.startswith("parentbased")
    assert root in description


def test_spans_are_exported_in_batches_and_flushed_on_shutdown(recorded: Recorded) -> None:
    tracing = recorded.tracing
    assert tracing.enabled
    assert tracing.server_interceptors and tracing.client_interceptors
    tracing.tracer.start_span("one").end()
    tracing.shutdown()  # flushes what the batch processor still holds
    [span] = recorded.exporter.get_finished_spans()
    assert span.name == "one"
    assert span.resource.attributes["service.name"] == "test"


def test_always_off_records_nothing() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing = Tracing.start(
        TelemetryConfig(service_name="t", tracing=TracingSettings(trace_sampler="always_off")),
        exporter,
    )
    span = tracing.tracer.start_span("dropped")
    assert not span.is_recording()
    span.end()
    tracing.shutdown()
    assert not exporter.get_finished_spans()


def test_traceparent_round_trip() -> None:
    ctx = span_context_of(TRACEPARENT)
    assert ctx is not None and ctx.is_remote
    assert traceparent_of(ctx) == TRACEPARENT
    assert context_of("") is None
    assert context_of("00-not-a-traceparent") is None


def test_the_caller_context_comes_from_grpc_metadata() -> None:
    assert context_from_metadata(None) is None
    assert context_from_metadata([("x-other", "1")]) is None
    ctx = context_from_metadata([("traceparent", TRACEPARENT.encode())])
    assert ctx is not None


def test_monotonic_times_become_epoch_nanoseconds() -> None:
    monotonic = iter([5_000_000_000, 7_500_000_000])
    clock = EpochClock(
        wall_ns=lambda: 1_700_000_000_000_000_000, monotonic_ns=lambda: next(monotonic)
    )
    assert clock.ns(5.0) == 1_700_000_000_000_000_000
    assert clock.now_ns() == 1_700_000_002_500_000_000
    assert clock.ns(2.0) - clock.ns(1.0) == 1_000_000_000
