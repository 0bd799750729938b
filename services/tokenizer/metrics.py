"""The tokenizer's metrics: what a client sees of each request, timed in this process.

The names are vLLM's with `tandem_` for `vllm:` (docs/observability.md has the map): time to
first token, inter-token latency, end-to-end latency, token counts and outcomes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.telemetry.metrics_server import (
    ITL_BUCKETS,
    REQUEST_BUCKETS,
    TTFT_BUCKETS,
    Families,
    token_buckets,
)


class TokenizerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = m = model_name
        f = Families(self.registry)
        self.ttft = f.histogram(
            "tandem_time_to_first_token_seconds",
            "Time from the Generate call to its first generated token.",
            TTFT_BUCKETS,
        ).labels(m)
        self.itl = f.histogram(
            "tandem_inter_token_latency_seconds",
            "Time between two messages of new tokens of one request.",
            ITL_BUCKETS,
        ).labels(m)
        self.tpot = f.histogram(
            "tandem_request_time_per_output_token_seconds",
            "Per request: (end-to-end latency - time to first token) / (output tokens - 1).",
            ITL_BUCKETS,
        ).labels(m)
        self.e2e = f.histogram(
            "tandem_e2e_request_latency_seconds",
            "Time from the Generate call to its last message.",
            REQUEST_BUCKETS,
        ).labels(m)
        token_edges = token_buckets(1 << 20)
        self.request_prompt_tokens = f.histogram(
            "tandem_request_prompt_tokens", "Prompt tokens per finished request.", token_edges
        ).labels(m)
        self.request_generation_tokens = f.histogram(
            "tandem_request_generation_tokens",
            "Generated tokens per finished request.",
            token_edges,
        ).labels(m)
        self.prompt_tokens = f.counter(
            "tandem_prompt_tokens", "Prompt tokens of the requests submitted to the scheduler."
        ).labels(m)
        self.generation_tokens = f.counter(
            "tandem_generation_tokens", "Tokens streamed to clients."
        ).labels(m)
        self._outcomes = f.counter(
            "tandem_request_success",
            "Generate calls by how they ended: stop or length, or the lower-cased gRPC status "
            "(cancelled, deadline_exceeded, invalid_argument, resource_exhausted, ...).",
            "finished_reason",
        )
        self._http = f.counter(
            "tandem_http_requests",
            "HTTP responses by method, route (its template; `other` for no route) and status, "
            "refusals before a request became a Generate call included.",
            "method",
            "route",
            "status",
        )
        self.running = f.gauge(
            "tandem_tokenizer_requests_in_flight", "Generate calls this tokenizer is serving now."
        ).labels(m)
        self.shm_in_use = f.gauge(
            "tandem_shm_bytes_in_use",
            "Bytes of shared memory holding live data (this process's segments).",
            "segment",
        )

    def http_response(self, method: str, route: str, status: int) -> None:
        self._http.labels(self.model_name, method, route, str(status)).inc()

    def outcome(self, finished_reason: str) -> None:
        self._outcomes.labels(self.model_name, finished_reason).inc()
