"""What a process's telemetry is configured with: its flags over the standard OTEL_* variables.

Tracing is off, with no exporter at all, unless an OTLP endpoint is configured and
`OTEL_SDK_DISABLED` is not true.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.settings import flag

PROTOCOLS = ("grpc", "http/protobuf")
# OTEL_TRACES_SAMPLER's names: each root sampler, alone or under ParentBased.
ROOT_SAMPLERS = ("always_on", "always_off", "traceidratio")
SAMPLERS = (*ROOT_SAMPLERS, *(f"parentbased_{name}" for name in ROOT_SAMPLERS))
DEFAULT_SAMPLER = "parentbased_always_on"


@dataclass(frozen=True)
class TracingSettings:
    otlp_endpoint: str = flag(
        "",
        "OTLP endpoint for traces, e.g. http://localhost:4317 (empty: tracing off)",
        env="OTEL_EXPORTER_OTLP_ENDPOINT",
    )
    otlp_traces_endpoint: str = flag(
        "",
        "the traces endpoint itself, used as given (instead of --otlp-endpoint)",
        env="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    )
    otlp_protocol: str = flag(
        "grpc", "OTLP transport", env="OTEL_EXPORTER_OTLP_PROTOCOL", choices=PROTOCOLS
    )
    trace_sampler: str = flag(
        DEFAULT_SAMPLER, "which traces are recorded", env="OTEL_TRACES_SAMPLER", choices=SAMPLERS
    )
    trace_sampler_arg: float = flag(
        1.0, "the ratio of the traceidratio samplers", env="OTEL_TRACES_SAMPLER_ARG"
    )
    otel_sdk_disabled: bool = flag(False, "no tracing at all", env="OTEL_SDK_DISABLED")

    def __post_init__(self) -> None:
        if not 0.0 <= self.trace_sampler_arg <= 1.0:
            raise ValueError(f"trace_sampler_arg must be in [0, 1], got {self.trace_sampler_arg}")

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint or self.otlp_traces_endpoint) and not self.otel_sdk_disabled

    @property
    def traces_endpoint(self) -> str:
        """The endpoint the exporter is given: host:port for gRPC, the full URL over HTTP."""
        endpoint = self.otlp_traces_endpoint or self.otlp_endpoint
        url = endpoint if "://" in endpoint else f"http://{endpoint}"
        if self.otlp_protocol == "http/protobuf" and not self.otlp_traces_endpoint:
            return url.rstrip("/") + "/v1/traces"
        return url


@dataclass(frozen=True)
class TelemetryConfig:
    service_name: str = flag("", "service name on this process's spans", env="OTEL_SERVICE_NAME")
    tracing: TracingSettings = field(default_factory=TracingSettings)
    metrics_port: int = flag(0, "serve Prometheus metrics at http://HOST:PORT/metrics (0: off)")
    metrics_host: str = flag("127.0.0.1", "address of the metrics endpoint")

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65536), got {self.metrics_port}")
