"""The tokenizer's metrics: what a client sees of each request, timed in this process.

The names are vLLM's with `tandem_` for `vllm:` (docs/observability.md has the map): time to
first token, inter-token latency, end-to-end latency, token counts and outcomes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.telemetry.metrics_server import (
    ITL_BUCKETS,
    REQUEST_BUCKETS,
    TTFT_BUCKETS,
    token_buckets,
)

_LABELS = ("model_name",)


class TokenizerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, _LABELS
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "Time from the Generate call to its first generated token.",
            labels,
            registry=r,
            buckets=TTFT_BUCKETS,
        ).labels(model_name)
        self.itl = Histogram(
            "tandem_inter_token_latency_seconds",
            "Time between two messages of new tokens of one request.",
            labels,
            registry=r,
            buckets=ITL_BUCKETS,
        ).labels(model_name)
        self.tpot = Histogram(
            "tandem_request_time_per_output_token_seconds",
            "Per request: (end-to-end latency - time to first token) / (output tokens - 1).",
            labels,
            registry=r,
            buckets=ITL_BUCKETS,
        ).labels(model_name)
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds",
            "Time from the Generate call to its last message.",
            labels,
            registry=r,
            buckets=REQUEST_BUCKETS,
        ).labels(model_name)
        token_edges = token_buckets(1 << 20)
        self.request_prompt_tokens = Histogram(
            "tandem_request_prompt_tokens",
            "Prompt tokens per finished request.",
            labels,
            registry=r,
            buckets=token_edges,
        ).labels(model_name)
        self.request_generation_tokens = Histogram(
            "tandem_request_generation_tokens",
            "Generated tokens per finished request.",
            labels,
            registry=r,
            buckets=token_edges,
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens",
            "Prompt tokens of the requests submitted to the scheduler.",
            labels,
            registry=r,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "tandem_generation_tokens",
            "Tokens streamed to clients.",
            labels,
            registry=r,
        ).labels(model_name)
        self._outcomes = Counter(
            "tandem_request_success",
            "Generate calls by how they ended: stop or length, or the lower-cased gRPC status "
            "(cancelled, deadline_exceeded, invalid_argument, resource_exhausted, ...).",
            (*labels, "finished_reason"),
            registry=r,
        )
        self.model_name = model_name
        self.running = Gauge(
            "tandem_tokenizer_requests_in_flight",
            "Generate calls this tokenizer is serving now.",
            labels,
            registry=r,
        ).labels(model_name)
        self.shm_in_use = Gauge(
            "tandem_shm_bytes_in_use",
            "Bytes of shared memory holding live data (this process's segments).",
            (*labels, "segment"),
            registry=r,
        )

    def outcome(self, finished_reason: str) -> None:
        self._outcomes.labels(self.model_name, finished_reason).inc()
