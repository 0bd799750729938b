"""A real OTLP/gRPC trace receiver, in-process on a free port: what Jaeger's 4317 port is to us.

Built on opentelemetry-proto's generated service; it keeps every span it is sent, flattened with
its service name, and lets a test wait until the spans it expects have arrived.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


def value_of(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(value_of(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def attributes_of(kvs: list[KeyValue]) -> dict[str, object]:
    return {kv.key: value_of(kv.value) for kv in kvs}


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, object]
    # (trace id, span id) of each link.
    links: list[tuple[str, str]]
    events: list[tuple[str, dict[str, object]]]
    status_code: int
    status_message: str
    resource: dict[str, object] = field(default_factory=dict)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = []
        for rs in request.resource_spans:
            resource = attributes_of(list(rs.resource.attributes))
            service = str(resource.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        ReceivedSpan(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes=attributes_of(list(s.attributes)),
                            links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                            events=[(e.name, attributes_of(list(e.attributes))) for e in s.events],
                            status_code=s.status.code,
                            status_message=s.status.message,
                            resource=resource,
                        )
                    )
        self.receiver.add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None)

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self.spans.extend(spans)
            self._changed.notify_all()

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout: float
    ) -> list[ReceivedSpan]:
        """The spans so far once `done(spans)` holds; TimeoutError with what arrived if not."""
        with self._changed:
            if not self._changed.wait_for(lambda: done(self.spans), timeout):
                got = sorted({(s.service, s.name) for s in self.spans})
                raise TimeoutError(f"spans not received in {timeout} s; got {got}")
            return list(self.spans)
