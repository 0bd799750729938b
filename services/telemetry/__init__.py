"""Traces (OpenTelemetry, exported over OTLP) and metrics (Prometheus) for the three processes.

Each process's `__main__` builds a `TelemetryConfig` from its flags and the standard `OTEL_*`
variables, starts `Tracing` and a `MetricsServer` from it, and hands the per-process pieces
(the tokenizer's `TokenizerTelemetry`, the scheduler's `SchedulerTelemetry`, the worker's
`WorkerTelemetry`) to the code that serves. See docs/observability.md.
"""
