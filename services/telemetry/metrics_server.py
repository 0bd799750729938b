"""One process's Prometheus endpoint: a registry of its own, served at http://HOST:PORT/metrics.

Each process keeps its families in its own `CollectorRegistry` (nothing in the global one), so
in-process tests can build as many as they like. The HTTP server is prometheus-client's, on a
daemon thread: a scrape never runs on the event loop.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

# Bucket edges as vLLM's (so dashboards' quantiles line up), in seconds or counts.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Queue time is often near zero on an idle server: finer edges below vLLM's first one.
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, *REQUEST_BUCKETS)
STEP_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def token_buckets(max_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_len` (vLLM's 1-2-5 series)."""
    series = (m * 10**exponent for exponent in itertools.count() for m in (1, 2, 5))
    return tuple(itertools.takewhile(lambda value: value <= max_len, series))


class Families:
    """Declares one process's families in its registry, each labelled by `model_name` first."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, ("model_name", *labels), registry=self.registry)

    def gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(name, doc, ("model_name", *labels), registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: Sequence[float], *labels: str) -> Histogram:
        return Histogram(
            name, doc, ("model_name", *labels), registry=self.registry, buckets=buckets
        )


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread
    port: int

    @classmethod
    def start(cls, host: str, port: int, registry: CollectorRegistry) -> MetricsServer | None:
        """Serve `registry` on host:port; None when port is 0 (metrics off)."""
        if not port:
            return None
        server, thread = start_http_server(port, addr=host, registry=registry)
        bound = int(server.server_address[1])
        log.info("metrics at http://%s:%d/metrics", host, bound)
        return cls(server, thread, bound)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5.0)
