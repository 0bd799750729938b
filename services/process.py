"""What every process is: settings read at its edge (`main`), then one lifecycle around what it
serves (`run_service`): health NOT_SERVING until its service has started, what start-up made
frozen out of the garbage collector's reach, and on SIGINT or SIGTERM NOT_SERVING again, the
server stopped within the service's grace, then the service.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from engine.errors import EngineError
from services.address import split_address
from services.client_types import MAX_MESSAGE_BYTES
from services.errors import CannotStart
from services.interceptors import ErrorInterceptor
from services.listen import CannotListen, bind_error
from services.settings import parse
from services.telemetry.config import TelemetryConfig
from services.telemetry.metrics_server import MetricsServer
from services.telemetry.tracing import Tracing
from services.tls import TlsSettings
from shm.reaper import reap

log = logging.getLogger("tandem.process")
C = TypeVar("C")


def _read(path: str) -> bytes | None:
    return Path(path).expanduser().read_bytes() if path else None


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    """A port's TLS; with CA certificates, clients must present a certificate they signed."""
    ca = _read(tls.ssl_ca_certs)
    return grpc.ssl_server_credentials(
        [(_read(tls.ssl_keyfile), _read(tls.ssl_certfile))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def channel_credentials(tls: TlsSettings) -> grpc.ChannelCredentials:
    """For a channel to another host's internal port: its CA, and this door's certificate as
    the client's (the peer may require one)."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ssl_ca_certs),
        private_key=_read(tls.ssl_keyfile),
        certificate_chain=_read(tls.ssl_certfile),
    )


class Health(HealthServicer):
    """grpc's health service, whose NOT_FOUND for a service it does not know says which (grpc's
    own gives no details)."""

    def __init__(self, services: Sequence[str]) -> None:
        super().__init__()
        self.services = frozenset(("", *services))

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self.services:
            known = ", ".join(repr(s) for s in sorted(self.services))
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"service {request.service!r} is not one of {known}"
            )
        return await super().Check(request, context)


@dataclass
class RunningServer:
    server: aio.Server
    health: Health
    port: int

    async def set_serving(self, serving: bool) -> None:
        statuses = health_pb2.HealthCheckResponse
        status = statuses.SERVING if serving else statuses.NOT_SERVING
        for name in self.health.services:
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
    tls: TlsSettings | None = None,
) -> RunningServer:
    """Start a server on `address` ("host:port", port 0 picks one) with health and reflection;
    with `tls`, `address` takes TLS only (the admin address, on loopback, stays plaintext).

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
    health = Health(service_names)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    if tls is not None and tls.enabled:
        creds = server_credentials(tls)
        port = _add_port(address, reuse_port, lambda: server.add_secure_port(address, creds))
    else:
        port = _add_port(address, reuse_port, lambda: server.add_insecure_port(address))
    # A port of this process alone, for health checks when several processes share `address`.
    if admin_address:
        _add_port(admin_address, False, lambda: server.add_insecure_port(admin_address))
    await server.start()
    running = RunningServer(server, health, port)
    await running.set_serving(serving)
    return running


def _add_port(address: str, reuse_port: bool, add: Callable[[], int]) -> int:
    """The port `add` bound; CannotListen, saying why, where gRPC could not bind `address`."""
    try:
        port = add()
    except RuntimeError:  # gRPC's "Failed to bind", without the reason
        port = 0
    if port == 0:
        host, wanted = split_address(address)
        raise CannotListen(address, bind_error(host, wanted, reuse_port))
    return port


def _exit_on_stop_signals() -> None:
    """While the service is built, SIGINT or SIGTERM ends the process at once, unwinding what
    was made so far. Building (a model loading, kernels compiling) holds the event loop, which
    would see the signal only once it is done: the launcher killed a worker 10 s after Ctrl-C."""

    def exit_now(signum: int, frame: object) -> None:
        raise SystemExit(0)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, exit_now)


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: the process's cue to drain and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def freeze_start_up(role: str) -> None:
    """Put every object start-up made (modules, the model's Python side, graphs' bookkeeping)
    out of the cyclic collector's reach. Otherwise each full collection walks all of them while
    serving, and in the worker, with torch loaded, that pause stops every step in flight; what
    serving allocates afterwards is collected as before (bench/RESULTS-gpu.md, session 51).
    At exit they are handed back, so that the interpreter's last collection finalizes them
    (Triton's bindings name every object still alive then as a leak)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    log.info("%s: %d objects of start-up kept out of collections", role, gc.get_freeze_count())


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


async def _nothing() -> None:
    return None


@dataclass
class Service:
    """What a process serves, as its builder made it: the lifecycle does the rest."""

    register: Callable[[aio.Server], None]  # adds the process's servicer(s) to a server
    service_names: Sequence[str]
    metrics: CollectorRegistry
    start: Callable[[], Awaitable[None]] = _nothing  # before SERVING: attach to peers
    # On the stop signal, beside the gRPC server's stop: other doors (HTTP) stop taking new
    # work and let what is in flight finish within grace_s.
    drain: Callable[[], Awaitable[None]] = _nothing
    stop: Callable[[], Awaitable[None]] = _nothing  # after the server stopped: close, unlink
    grace_s: float = 5.0  # in-flight calls may finish within this after the stop signal
    reuse_port: bool = False  # several processes share the address (tokenizers)
    admin_address: str | None = None
    interceptors: Sequence[aio.ServerInterceptor] = field(default_factory=tuple)
    tls: TlsSettings | None = None  # for `address`


async def run_service(
    role: str,
    address: str,
    telemetry: TelemetryConfig,
    build: Callable[[Tracing], Awaitable[Service]],
) -> int:
    _exit_on_stop_signals()
    reap()  # what crashed processes left in a shared /dev/shm (e.g. across containers)
    tracing = Tracing.start(telemetry)
    service = await build(tracing)
    stop = stop_event_on_signals()  # from here a stop drains what the process serves
    metrics = MetricsServer.start(telemetry.metrics_host, telemetry.metrics_port, service.metrics)
    server = await start_server(
        address,
        service.register,
        service.service_names,
        serving=False,
        reuse_port=service.reuse_port,
        admin_address=service.admin_address,
        interceptors=[*tracing.server_interceptors, *service.interceptors],
        tls=service.tls,
    )
    log.info("%s on port %d", role, server.port)
    code = 0
    try:
        started = await _start_unless_stopped(service, stop)
    except CannotStart as err:
        log.error("%s cannot start: %s", role, err)
        started, code = False, 2
    if started:
        freeze_start_up(role)
        await server.set_serving(True)
        await stop.wait()
        log.info("%s stopping", role)
        await server.set_serving(False)
        await asyncio.gather(server.stop(grace=service.grace_s), service.drain())
    else:
        if code == 0:
            log.info("%s stopped while it attached to its peers", role)
        await server.stop(grace=0)
    await service.stop()
    if metrics is not None:
        metrics.stop()
    await asyncio.to_thread(tracing.shutdown)
    return code


async def _start_unless_stopped(service: Service, stop: asyncio.Event) -> bool:
    """service.start(), unless a stop signal comes first (False): attaching to peers may wait
    for one still loading (a scheduler for its worker), and under compose a stop must not wait
    for that."""
    starting = asyncio.ensure_future(service.start())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if starting.done():
        starting.result()  # CannotStart, or what else went wrong, is raised here
        return True
    starting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await starting
    return False


def main(
    role: str,
    config_type: type[C],
    serve: Callable[[C], Coroutine[Any, Any, int]],
    description: str | None,
) -> int:
    """`python -m services.ROLE`: its settings, then `serve(config)` on the event loop."""
    setup_logging(role)
    try:
        config = settings_of(role, config_type, None, description or "")
    except (ValueError, EngineError) as err:
        print(f"{role}: error: {err}", file=sys.stderr)
        return 2
    try:
        return run(lambda: serve(config))
    # What the engine refused as it loaded (a file, a setting), an address it cannot listen on.
    except (EngineError, CannotStart) as err:
        print(f"{role}: error: {err}", file=sys.stderr)
        return 2


def settings_of(
    role: str,
    config_type: type[C],
    argv: Sequence[str] | None,
    description: str = "",
    env: Mapping[str, str] = os.environ,
) -> C:
    """The process's settings from its flags, --config file and environment; each process's
    spans are named tandem-ROLE unless its settings say otherwise."""
    prog = f"python -m services.{role}"
    config = parse(config_type, argv, env, prog=prog, description=description)
    telemetry = getattr(config, "telemetry", None)
    if isinstance(telemetry, TelemetryConfig) and not telemetry.service_name:
        named = dataclasses.replace(telemetry, service_name=f"tandem-{role}")
        config = dataclasses.replace(config, telemetry=named)  # type: ignore[type-var]
    return config
