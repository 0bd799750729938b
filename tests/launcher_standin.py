"""A stand-in child for the launcher's tests (`python -m launcher_standin ADDRESS`, with tests/
on the path): it serves gRPC health as NOT_SERVING, and once a watcher has had its first reply it
stops its server and, a second later, exits with code 2, as the scheduler does when the worker's
model cannot be scheduled. Its start fails after the launcher's health watch connected."""

from __future__ import annotations

import asyncio
import sys

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer


class _Watched(HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self.watched = asyncio.Event()

    async def Watch(self, request, context):  # type: ignore[no-untyped-def]
        asyncio.get_running_loop().call_later(0.2, self.watched.set)  # after its first reply
        await super().Watch(request, context)


async def _main(address: str) -> int:
    servicer = _Watched()
    await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server = aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    await server.start()
    await servicer.watched.wait()
    await server.stop(grace=0)
    await asyncio.sleep(1.0)  # what a process does before it exits: close, flush, tear down
    return 2


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(sys.argv[1])))
