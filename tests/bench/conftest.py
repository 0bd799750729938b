"""The fake tandem server of the bench tests, in this process on port 0."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from fake_tandem import FakeTandem, Plan
from grpc import aio

from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

PlanFn = Callable[[pb.GenerateRequest], Plan]
StartTandem = Callable[[PlanFn], Awaitable[tuple[str, FakeTandem]]]


@pytest.fixture
async def tandem_server() -> AsyncIterator[StartTandem]:
    """`await tandem_server(plan)` → (address, servicer); the servers stop after the test."""
    servers: list[aio.Server] = []

    async def start(plan: PlanFn) -> tuple[str, FakeTandem]:
        servicer = FakeTandem(plan)
        server = aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", servicer

    yield start
    for server in servers:
        await server.stop(None)
