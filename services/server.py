"""What every process does with gRPC: serve with health and reflection; stop on a signal."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from services.interceptors import ErrorInterceptor

MAX_MESSAGE_BYTES = 64 << 20


@dataclass
class RunningServer:
    server: aio.Server
    health: HealthServicer
    port: int
    service_names: Sequence[str]

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def start_server(
    address: str,
    register: Callable[[aio.Server], None],
    service_names: Sequence[str],
    *,
    serving: bool = True,
    reuse_port: bool = False,
    admin_address: str | None = None,
    interceptors: Sequence[aio.ServerInterceptor] = (),
) -> RunningServer:
    """Start a server on `address` ("host:port", port 0 picks one) with health and reflection.

    `interceptors` run outside the error interceptor (tracing sees the status it sets)."""
    server = aio.server(
        interceptors=[*interceptors, ErrorInterceptor()],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ],
    )
    register(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    # A port of this process alone, for health checks when several processes share `address`.
    if admin_address and server.add_insecure_port(admin_address) == 0:
        raise OSError(f"could not bind {admin_address}")
    await server.start()
    running = RunningServer(server, health, port, service_names)
    await running.set_serving(serving)
    return running


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: the process's cue to drain and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def setup_logging(process: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s {process}[%(process)d] %(levelname)s %(name)s: %(message)s",
    )


def run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run a process's async main on uvloop where it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())
