"""A process's tracer: set up once from its TelemetryConfig, flushed once at shutdown.

With tracing off there is no provider, no exporter and no thread: `tracer` is OpenTelemetry's
no-op tracer and `enabled` is False, so callers skip span work altogether. With tracing on,
spans are exported in batches by the SDK's BatchSpanProcessor from its own thread, never from
the event loop or the step loop. The tracer is passed to whoever needs it; the global provider
is left alone.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from grpc import aio
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)

from services.telemetry.config import TelemetryConfig, TracingSettings

log = logging.getLogger(__name__)

INSTRUMENTATION = "tandem"
# A step span links to every request it served: room for a full batch (max_num_seqs).
MAX_LINKS = 1024
# The gRPC calls that belong to one request and so carry its trace context in metadata. Health,
# attach, describe and the event stream are process-scoped; steps carry theirs in the record.
TRACED_METHODS = ("Submit", "Cancel")
FLUSH_TIMEOUT_MS = 5000


def make_sampler(name: str, ratio: float) -> Sampler:
    roots = {"always_on": ALWAYS_ON, "always_off": ALWAYS_OFF, "traceidratio": None}
    root = name.removeprefix("parentbased_")
    if root not in roots:
        raise ValueError(f"unknown trace sampler {name!r}")
    sampler = roots[root] or TraceIdRatioBased(ratio)
    return ParentBased(sampler) if root != name else sampler


def make_exporter(config: TracingSettings) -> SpanExporter:
    endpoint = config.traces_endpoint
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPExporter,
        )
    except ImportError:
        raise ValueError(
            "OTLP over http/protobuf needs the opentelemetry-exporter-otlp-proto-http package; "
            "install it, or use the grpc protocol"
        ) from None
    return HTTPExporter(endpoint=endpoint)


@dataclass
class Tracing:
    tracer: trace.Tracer
    provider: TracerProvider | None = None
    server_interceptors: Sequence[aio.ServerInterceptor] = field(default_factory=tuple)
    client_interceptors: Sequence[aio.ClientInterceptor] = field(default_factory=tuple)

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    @classmethod
    def off(cls) -> Tracing:
        return cls(trace.NoOpTracer())

    @classmethod
    def start(cls, config: TelemetryConfig, exporter: SpanExporter | None = None) -> Tracing:
        """Tracing as configured; `exporter` replaces the OTLP one (tests)."""
        settings = config.tracing
        if not settings.enabled and exporter is None:
            return cls.off()
        resource = Resource.create(
            {
                "service.name": config.service_name,
                "service.namespace": "tandem",
                "service.instance.id": f"{socket.gethostname()}-{os.getpid()}",
                "process.pid": os.getpid(),
            }
        )
        provider = TracerProvider(
            sampler=make_sampler(settings.trace_sampler, settings.trace_sampler_arg),
            resource=resource,
            span_limits=SpanLimits(max_links=MAX_LINKS),
        )
        provider.add_span_processor(BatchSpanProcessor(exporter or make_exporter(settings)))
        log.info(
            "tracing to %s over %s as %s (sampler %s)",
            settings.traces_endpoint,
            settings.otlp_protocol,
            config.service_name,
            settings.trace_sampler,
        )
        from opentelemetry.instrumentation.grpc import (
            aio_client_interceptors,
            aio_server_interceptor,
            filters,
        )

        traced = filters.any_of(*(filters.method_name(m) for m in TRACED_METHODS))
        return cls(
            provider.get_tracer(INSTRUMENTATION),
            provider,
            [aio_server_interceptor(tracer_provider=provider, filter_=traced)],
            aio_client_interceptors(tracer_provider=provider, filter_=traced),
        )

    def shutdown(self) -> None:
        """Export what is still queued, then stop the exporter (blocking: call it off the loop)."""
        if self.provider is None:
            return
        if not self.provider.force_flush(FLUSH_TIMEOUT_MS):
            log.warning("some spans were not exported within %d ms", FLUSH_TIMEOUT_MS)
        self.provider.shutdown()
