"""The worker's metrics: one observation per step (its size, its tokens, how long it took)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.telemetry.metrics_server import (
    BATCH_BUCKETS,
    STEP_BUCKETS,
    Families,
    token_buckets,
)


class WorkerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        f, m = Families(self.registry), model_name
        self.step_duration = f.histogram(
            "tandem_step_duration_seconds",
            "Wall time of one step in the worker, from its launch until its outputs are read "
            "(on CUDA with --overlap-steps, after the next step's launch if that is decode-only).",
            STEP_BUCKETS,
        ).labels(m)
        launch = f.histogram(
            "tandem_step_launch_seconds",
            "Host time to launch one step (its inputs read, the engine's preparation, its kernels "
            "queued; on CPU the whole step), by whether it carries prefill tokens.",
            STEP_BUCKETS,
            "kind",
        )
        self.launch_prefill = launch.labels(m, "prefill")
        self.launch_decode = launch.labels(m, "decode")
        self.batch_size = f.histogram(
            "tandem_step_batch_size", "Sequences in one step.", BATCH_BUCKETS
        ).labels(m)
        self.iteration_tokens = f.histogram(
            "tandem_iteration_tokens_total",
            "Tokens (prefill and decode) in one step.",
            token_buckets(1 << 16),
        ).labels(m)
        tokens = f.counter(
            "tandem_step_tokens",
            "Tokens run through the model, by kind: prefill (prompt and re-prefill) or decode.",
            "kind",
        )
        self.prefill_tokens = tokens.labels(m, "prefill")
        self.decode_tokens = tokens.labels(m, "decode")
        self.failures = f.counter(
            "tandem_step_failures",
            "Steps in which some sequence could not run (its request fails alone).",
        ).labels(m)
