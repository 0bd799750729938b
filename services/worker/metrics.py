"""The worker's metrics: one observation per step (its size, its tokens, how long it took)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.telemetry.metrics_server import BATCH_BUCKETS, STEP_BUCKETS, token_buckets

_LABELS = ("model_name",)


class WorkerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels, m = self.registry, _LABELS, model_name
        self.step_duration = Histogram(
            "tandem_step_duration_seconds",
            "Wall time of one step in the worker: reading its inputs, the forward pass, sampling.",
            labels,
            registry=r,
            buckets=STEP_BUCKETS,
        ).labels(m)
        self.batch_size = Histogram(
            "tandem_step_batch_size",
            "Sequences in one step.",
            labels,
            registry=r,
            buckets=BATCH_BUCKETS,
        ).labels(m)
        self.iteration_tokens = Histogram(
            "tandem_iteration_tokens_total",
            "Tokens (prefill and decode) in one step.",
            labels,
            registry=r,
            buckets=token_buckets(1 << 16),
        ).labels(m)
        tokens = Counter(
            "tandem_step_tokens",
            "Tokens run through the model, by kind: prefill (prompt and re-prefill) or decode.",
            (*labels, "kind"),
            registry=r,
        )
        self.prefill_tokens = tokens.labels(m, "prefill")
        self.decode_tokens = tokens.labels(m, "decode")
        self.failures = Counter(
            "tandem_step_failures",
            "Steps in which some sequence could not run (its request fails alone).",
            labels,
            registry=r,
        ).labels(m)
