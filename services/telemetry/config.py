"""What a process's telemetry is configured with: its flags over the standard OTEL_* variables.

Read once in each process's `__main__` (flags first, then the environment it was given, then
defaults), validated here, and passed down frozen. Tracing is off, with no exporter at all, unless
an OTLP endpoint is configured and `OTEL_SDK_DISABLED` is not true.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
DEFAULT_SAMPLER = "parentbased_always_on"


@dataclass(frozen=True)
class TelemetryConfig:
    service_name: str
    # Where spans go: OTLP's base endpoint (http://host:4317), or the traces endpoint itself
    # when it came from OTEL_EXPORTER_OTLP_TRACES_ENDPOINT. Empty: tracing off.
    otlp_endpoint: str = ""
    otlp_protocol: str = "grpc"
    # True when `otlp_endpoint` is a signal-specific endpoint (used as is over HTTP, no /v1/traces).
    endpoint_is_traces: bool = False
    sampler: str = DEFAULT_SAMPLER
    # The ratio of the *traceidratio samplers, in [0, 1].
    sampler_arg: float = 1.0
    sdk_disabled: bool = False
    # The /metrics HTTP port of this process; 0: no metrics endpoint.
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not self.service_name:
            raise ValueError("the service name must not be empty")
        if self.otlp_protocol not in PROTOCOLS:
            raise ValueError(
                f"OTLP protocol must be one of {', '.join(PROTOCOLS)}, got {self.otlp_protocol!r}"
            )
        if self.sampler not in SAMPLERS:
            raise ValueError(
                f"trace sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}"
            )
        if not 0.0 <= self.sampler_arg <= 1.0:
            raise ValueError(f"the sampler's ratio must be in [0, 1], got {self.sampler_arg}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics port must be in [0, 65536), got {self.metrics_port}")

    @property
    def tracing(self) -> bool:
        return bool(self.otlp_endpoint) and not self.sdk_disabled

    @property
    def traces_endpoint(self) -> str:
        """The endpoint the exporter is given: host:port for gRPC, the full URL over HTTP."""
        url = self.otlp_endpoint if "://" in self.otlp_endpoint else f"http://{self.otlp_endpoint}"
        if self.otlp_protocol == "http/protobuf" and not self.endpoint_is_traces:
            return url.rstrip("/") + "/v1/traces"
        return url


def add_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str], role: str) -> None:
    """The telemetry flags of one process; their defaults come from the OTEL_* variables."""
    group = parser.add_argument_group("telemetry")
    group.add_argument(
        "--otlp-endpoint",
        default=env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        help="OTLP endpoint for traces, e.g. http://localhost:4317 (default "
        "$OTEL_EXPORTER_OTLP_ENDPOINT; empty: tracing off)",
    )
    group.add_argument(
        "--otlp-protocol",
        choices=PROTOCOLS,
        default=env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc",
        help="OTLP transport (default $OTEL_EXPORTER_OTLP_PROTOCOL or grpc)",
    )
    group.add_argument(
        "--service-name",
        default=env.get("OTEL_SERVICE_NAME") or f"tandem-{role}",
        help=f"service name on this process's spans (default $OTEL_SERVICE_NAME or tandem-{role})",
    )
    group.add_argument(
        "--trace-sampler",
        choices=SAMPLERS,
        default=env.get("OTEL_TRACES_SAMPLER") or DEFAULT_SAMPLER,
        help=f"which traces are recorded (default $OTEL_TRACES_SAMPLER or {DEFAULT_SAMPLER})",
    )
    group.add_argument(
        "--trace-sampler-arg",
        type=float,
        default=None,
        help="the ratio of the traceidratio samplers (default $OTEL_TRACES_SAMPLER_ARG or 1.0)",
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default 0: off)",
    )
    group.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of the metrics endpoint"
    )


def from_args(args: argparse.Namespace, env: Mapping[str, str]) -> TelemetryConfig:
    """The config from parsed flags; raises ValueError naming a bad flag or variable."""
    arg = args.trace_sampler_arg
    if arg is None:
        raw = env.get("OTEL_TRACES_SAMPLER_ARG", "")
        try:
            arg = float(raw) if raw else 1.0
        except ValueError:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a number, got {raw!r}") from None
    traces_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
    return TelemetryConfig(
        service_name=args.service_name,
        otlp_endpoint=args.otlp_endpoint,
        otlp_protocol=args.otlp_protocol,
        endpoint_is_traces=bool(traces_endpoint) and args.otlp_endpoint == traces_endpoint,
        sampler=args.trace_sampler,
        sampler_arg=arg,
        sdk_disabled=env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true",
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )
