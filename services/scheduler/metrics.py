"""The scheduler's metrics: its queue and KV gauges, cache and preemption counters, and the
per-request phase durations (queue, prefill, decode) timed on its clock.

Gauges and counters are refreshed from the core's `SchedulerStats` snapshot each time the loop
wakes, on the loop's thread; the core's totals restart with a new worker (a new core), so the
counters here add up the differences and never go back.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.scheduler.state import SchedulerStats
from services.telemetry.metrics_server import (
    QUEUE_BUCKETS,
    REQUEST_BUCKETS,
    STEP_BUCKETS,
    Families,
)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = ""
        f = Families(self.registry)
        self._running = f.gauge("tandem_num_requests_running", "Requests in the running batch.")
        self._waiting = f.gauge(
            "tandem_num_requests_waiting",
            "Requests waiting to be scheduled (preempted ones included).",
        )
        self._kv_usage = f.gauge(
            "tandem_kv_cache_usage_perc",
            "Share of the KV-cache blocks held by sequences and by sessions kept for their "
            "next turn (0 to 1).",
        )
        self._prefix_queries = f.counter(
            "tandem_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self._prefix_hits = f.counter(
            "tandem_prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self._preemptions = f.counter(
            "tandem_num_preemptions", "Requests preempted (KV or priority)."
        )
        self._steps = f.counter("tandem_scheduler_steps", "Steps planned and sent to the worker.")
        self._backlog_steps = f.counter(
            "tandem_scheduler_backlog_steps",
            "Of the steps, those given the larger budget while a backlog waited.",
        )
        self._queue = f.histogram(
            "tandem_request_queue_time_seconds",
            "Time from arrival at the scheduler to first admission.",
            QUEUE_BUCKETS,
        )
        self._prefill = f.histogram(
            "tandem_request_prefill_time_seconds",
            "Time from first admission to the first generated token.",
            REQUEST_BUCKETS,
        )
        self._decode = f.histogram(
            "tandem_request_decode_time_seconds",
            "Time from the first generated token to the last.",
            REQUEST_BUCKETS,
        )
        self._inference = f.histogram(
            "tandem_request_inference_time_seconds",
            "Time from first admission to the end (prefill + decode, preemptions included).",
            REQUEST_BUCKETS,
        )
        self._hop = f.histogram(
            "tandem_step_hop_seconds",
            "One-way latency of a step record, scheduler to worker (to_worker) and back.",
            STEP_BUCKETS,
            "direction",
        )
        self._last = (0, 0, 0, 0, 0)
        self.set_model(self.model_name)

    def set_model(self, model_name: str) -> None:
        """Label the families with the model the worker serves (known once it is attached)."""
        families = (self._running, self._waiting, self._kv_usage, self._prefix_queries,
                    self._prefix_hits, self._preemptions, self._steps, self._backlog_steps,
                    self._queue,
                    self._prefill, self._decode, self._inference, self._hop)  # fmt: skip
        if model_name != self.model_name:
            # The placeholder series made before the worker was known would show as zeros.
            for family in families:
                family.clear()
        self.model_name = model_name
        m = model_name
        self.running, self.waiting = self._running.labels(m), self._waiting.labels(m)
        self.kv_usage = self._kv_usage.labels(m)
        self.prefix_queries = self._prefix_queries.labels(m)
        self.prefix_hits = self._prefix_hits.labels(m)
        self.preemptions, self.steps = self._preemptions.labels(m), self._steps.labels(m)
        self.backlog_steps = self._backlog_steps.labels(m)
        self.queue_time, self.prefill_time = self._queue.labels(m), self._prefill.labels(m)
        self.decode_time, self.inference_time = self._decode.labels(m), self._inference.labels(m)
        self.hop_to_worker = self._hop.labels(m, "to_worker")
        self.hop_to_scheduler = self._hop.labels(m, "to_scheduler")

    def observe_stats(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        now = (
            s.prefix_cache_queries,
            s.prefix_cache_hits,
            s.num_preemptions,
            s.num_steps,
            s.num_backlog_steps,
        )
        counters = (
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.steps,
            self.backlog_steps,
        )
        for counter, new, old in zip(counters, now, self._last, strict=True):
            # A smaller total means a new core (the worker restarted): it counts from zero.
            delta = new - old if new >= old else new
            if delta:
                counter.inc(delta)
        self._last = now
