"""The servers `tandem bench` can drive: each turns a `RequestSpec` into a stream of `Event`s.

A backend raises `RequestFailed` for anything that ends a request early (a gRPC status, an HTTP
error, a broken stream), so the runner can record it; it opens its connections on enter.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from services.bench.config import BenchConfig, Target
from services.bench.record import Event
from services.bench.workload import RequestSpec


class Backend(Protocol):
    def stream(self, spec: RequestSpec) -> AsyncGenerator[Event, None]: ...


def open_backend(target: Target, config: BenchConfig) -> AbstractAsyncContextManager[Backend]:
    # Imported on use: a run against tandem alone needs no httpx, one against OpenAI no grpc.
    if target.backend == "tandem":
        from services.bench.backends.tandem import open_tandem

        return open_tandem(target.url, config)
    from services.bench.backends.openai import open_openai

    return open_openai(target.url, config)
