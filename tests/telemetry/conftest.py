"""Tracing into memory, for tests of the per-process telemetry without any exporter or process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.telemetry.config import TelemetryConfig
from services.telemetry.tracing import Tracing


class Recorded:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracing = Tracing.start(TelemetryConfig(service_name="test"), self.exporter)

    def spans(self) -> list[ReadableSpan]:
        if self.tracing.provider is not None:
            self.tracing.provider.force_flush()
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans() if s.name == name]


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    rec = Recorded()
    yield rec
    rec.tracing.shutdown()
