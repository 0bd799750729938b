"""python -m services.tokenizer: the public gRPC edge — tokenize, submit, stream text back."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from engine import registry
from engine.errors import EngineError
from services.server import run, setup_logging, start_server, stop_event_on_signals
from services.telemetry import config as telemetry_config
from services.telemetry.config import TelemetryConfig
from tandem.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("tandem.tokenizer")


@dataclass(frozen=True)
class TokenizerConfig:
    model_path: Path
    model_name: str
    tokenizer_path: Path
    host: str
    port: int
    admin_port: int
    scheduler: str
    shared_memory: bool
    arena_bytes: int
    tokenizer_id: str
    telemetry: TelemetryConfig

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.arena_bytes < 1 << 20:
            raise ValueError("the prompt arena needs at least 1 MiB")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_args(argv: list[str] | None = None) -> TokenizerConfig:
    parser = argparse.ArgumentParser(prog="python -m services.tokenizer", description=__doc__)
    parser.add_argument(
        "--model",
        default=os.environ.get("TANDEM_MODEL", registry.DEFAULT_MODEL),
        help="model name or path (its tokenizer and chat template are used)",
    )
    parser.add_argument("--tokenizer", help="a tokenizer name or path instead of the model's")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument(
        "--admin-port",
        type=int,
        default=0,
        help="a port of this process alone (health, metrics) when several share --port",
    )
    parser.add_argument("--scheduler", default="127.0.0.1:50052", help="the scheduler's address")
    parser.add_argument(
        "--transport",
        choices=["shm", "grpc"],
        default="shm",
        help="prompts and events through shared memory, or all over gRPC",
    )
    parser.add_argument("--arena-mb", type=int, default=64, help="shared memory for prompts")
    parser.add_argument(
        "--home",
        type=Path,
        default=Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser(),
    )
    env = dict(os.environ)
    telemetry_config.add_arguments(parser, env, "tokenizer")
    args = parser.parse_args(argv)
    model_path = registry.resolve(args.model, args.home)
    tokenizer_path = registry.resolve(args.tokenizer, args.home) if args.tokenizer else model_path
    return TokenizerConfig(
        model_path=model_path,
        model_name=args.model,
        tokenizer_path=tokenizer_path,
        host=args.host,
        port=args.port,
        admin_port=args.admin_port,
        scheduler=args.scheduler,
        shared_memory=args.transport == "shm",
        arena_bytes=args.arena_mb << 20,
        tokenizer_id=f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        telemetry=telemetry_config.from_args(args, env),
    )


async def serve(config: TokenizerConfig) -> int:
    from grpc import aio

    from engine.tokenizer import load_tokenizer
    from services.telemetry.generate_trace import GenerateTelemetry
    from services.telemetry.metrics_server import MetricsServer
    from services.telemetry.tokenizer_metrics import TokenizerMetrics
    from services.telemetry.tracing import Tracing
    from services.tokenizer.events import EventRouter
    from services.tokenizer.service import GenerationServicer
    from shm.arena import Arena
    from shm.reaper import reap
    from tandem.internal.v1 import scheduler_pb2_grpc

    stop = stop_event_on_signals()
    reap()  # what crashed processes left in a shared /dev/shm (e.g. across containers)
    tracing = Tracing.start(config.telemetry)
    metrics = TokenizerMetrics(config.model_name)
    tokenizer = load_tokenizer(config.tokenizer_path)
    arena = Arena.create(config.arena_bytes) if config.shared_memory else None
    if arena is not None:
        capacity = arena.free_bytes
        in_use = metrics.shm_in_use.labels(config.model_name, "prompt_arena")
        in_use.set_function(lambda: capacity - arena.free_bytes)
    metrics_server = MetricsServer.start(
        config.telemetry.metrics_host, config.telemetry.metrics_port, metrics.registry
    )
    channel = aio.insecure_channel(
        config.scheduler,
        options=[
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ],
        interceptors=tracing.client_interceptors,
    )
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    router = EventRouter(stub, config.tokenizer_id, arena)
    servicer = GenerationServicer(
        tokenizer,
        config.model_name,
        stub,
        router,
        arena,
        GenerateTelemetry(tracing, metrics, config.model_name),
    )
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    server = await start_server(
        config.address,
        lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
        [service],
        serving=False,
        reuse_port=True,  # several tokenizer processes may share the public port
        admin_address=f"127.0.0.1:{config.admin_port}" if config.admin_port else None,
    )
    log.info(
        "tokenizer %s on port %d, attaching to the scheduler at %s",
        config.tokenizer_id,
        server.port,
        config.scheduler,
    )
    await router.start()
    await server.set_serving(True)
    await stop.wait()
    log.info("draining")
    await server.set_serving(False)
    await server.stop(grace=10.0)
    await router.stop()
    await channel.close()
    if arena is not None:
        arena.close()
    if metrics_server is not None:
        metrics_server.stop()
    await asyncio.to_thread(tracing.shutdown)
    return 0


def main(argv: list[str] | None = None) -> int:
    setup_logging("tokenizer")
    try:
        config = parse_args(argv)
    except (EngineError, ValueError) as err:
        print(f"tokenizer: error: {err}", file=sys.stderr)
        return 2
    return run(lambda: serve(config))


if __name__ == "__main__":
    sys.exit(main())
