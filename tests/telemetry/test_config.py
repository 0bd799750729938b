"""TelemetryConfig from flags and the standard OTEL_* variables; tracing off unless configured."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.process import settings_of
from services.telemetry.config import TelemetryConfig
from services.telemetry.tracing import Tracing


@dataclass(frozen=True)
class Process:
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)


def parse(env: dict[str, str], *argv: str, role: str = "worker") -> TelemetryConfig:
    return settings_of(role, Process, list(argv), env=env).telemetry


def test_nothing_configured_means_tracing_and_metrics_off() -> None:
    config = parse({})
    assert not config.tracing.enabled
    assert config.metrics_port == 0
    assert config.service_name == "tandem-worker"
    assert config.tracing.trace_sampler == "parentbased_always_on"
    assert config.tracing.trace_sampler_arg == 1.0
    tracing = Tracing.start(config)
    assert not tracing.enabled
    assert tracing.provider is None
    assert not tracing.server_interceptors and not tracing.client_interceptors
    with tracing.tracer.start_as_current_span("x") as span:
        assert not span.is_recording()
    tracing.shutdown()  # nothing to flush, and no error


@pytest.mark.parametrize("role", ["tokenizer", "scheduler", "worker"])
def test_each_process_has_its_own_service_name(role: str) -> None:
    assert parse({}, role=role).service_name == f"tandem-{role}"


def test_standard_variables_are_read() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_SERVICE_NAME": "edge",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    config = parse(env)
    t = config.tracing
    assert t.enabled
    assert t.otlp_endpoint == "http://collector:4317"
    assert t.traces_endpoint == "http://collector:4317"
    assert t.otlp_protocol == "grpc"
    assert config.service_name == "edge"
    assert t.trace_sampler == "parentbased_traceidratio" and t.trace_sampler_arg == 0.25


def test_flags_win_over_the_environment() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    config = parse(
        env,
        "--otlp-endpoint",
        "http://b:4317",
        "--service-name",
        "tandem-worker-2",
        "--trace-sampler",
        "traceidratio",
        "--trace-sampler-arg",
        "0.1",
        "--metrics-port",
        "9400",
    )
    assert config.tracing.otlp_endpoint == "http://b:4317"
    assert config.service_name == "tandem-worker-2"
    assert config.tracing.trace_sampler == "traceidratio"
    assert config.tracing.trace_sampler_arg == 0.1
    assert config.metrics_port == 9400


def test_sdk_disabled_turns_tracing_off_even_with_an_endpoint() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317", "OTEL_SDK_DISABLED": "TRUE"}
    config = parse(env)
    assert not config.tracing.enabled
    assert not Tracing.start(config).enabled


def test_http_protocol_appends_the_traces_path_unless_the_endpoint_is_signal_specific() -> None:
    base = parse(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318/",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        }
    )
    assert base.tracing.traces_endpoint == "http://a:4318/v1/traces"
    specific = parse(
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://a:4318/custom",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        }
    )
    assert specific.tracing.traces_endpoint == "http://a:4318/custom"


def test_an_endpoint_without_a_scheme_is_plain_http() -> None:
    config = parse({}, "--otlp-endpoint", "localhost:4317")
    assert config.tracing.traces_endpoint == "http://localhost:4317"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
        ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG"),
        ({"OTEL_TRACES_SAMPLER_ARG": "1.5"}, "trace_sampler_arg"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ],
)
def test_bad_values_are_refused_with_the_setting_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(env)


def test_a_bad_metrics_port_is_refused() -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        TelemetryConfig(service_name="x", metrics_port=70000)
