"""What the three processes share of telemetry: its settings, the tracer, trace-context
propagation and the Prometheus endpoint. Each process's own spans and metric families live in
its package (services/tokenizer/telemetry.py and metrics.py, and so on). See
docs/observability.md.
"""
