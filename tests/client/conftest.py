"""The fake server in this process, on port 0, for the client and CLI tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from fake_server import FakeGeneration, FakeServer
from grpc import aio
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from tandem.v1 import generation_pb2_grpc


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    servicer = FakeGeneration()
    health = health_aio.HealthServicer()
    server = aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    running = FakeServer(f"127.0.0.1:{port}", servicer, health)
    await running.set_serving(True)
    yield running
    await server.stop(None)
