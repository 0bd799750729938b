"""python -m services.tokenizer: the public edge — gRPC, and OpenAI's HTTP API on the same event
loop — tokenize, submit, stream text back."""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from services.process import Service, channel_credentials, main, run_service, settings_of
from services.telemetry.tracing import Tracing
from services.tokenizer.config import TokenizerConfig

log = logging.getLogger("tandem.tokenizer")
GRACE_S = 10.0  # in-flight requests may finish within this after the stop signal


def parse_args(argv: Sequence[str] | None = None) -> TokenizerConfig:
    return settings_of("tokenizer", TokenizerConfig, argv, __doc__ or "")


async def serve(config: TokenizerConfig) -> int:
    async def build(tracing: Tracing) -> Service:
        from grpc import aio

        from engine import registry
        from engine.tokenizer import load_chat_template, load_tokenizer
        from services.tokenizer.admission import Admission
        from services.tokenizer.auth import ApiKeys, AuthInterceptor
        from services.tokenizer.metrics import TokenizerMetrics
        from services.tokenizer.scheduler_link import SchedulerLink
        from services.tokenizer.service import GenerationServicer
        from services.tokenizer.telemetry import TokenizerTelemetry
        from shm.arena import Arena
        from tandem.internal.v1 import scheduler_pb2_grpc
        from tandem.v1 import generation_pb2, generation_pb2_grpc

        home, name = Path(config.model.home).expanduser(), config.model.model
        tokenizer = load_tokenizer(registry.resolve(config.tokenizer or name, home))
        if config.chat_template:
            tokenizer.chat_template = load_chat_template(config.chat_template)
        name = config.served_model_name or name  # what clients call the model
        metrics = TokenizerMetrics(name)
        arena = Arena.create(config.arena_mb << 20) if config.transport == "shm" else None
        if arena is not None:
            capacity = arena.free_bytes
            in_use = metrics.shm_in_use.labels(name, "prompt_arena")
            in_use.set_function(lambda: capacity - arena.free_bytes)
        options = [
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        interceptors = tracing.client_interceptors
        if config.tls.secures(config.scheduler):  # a scheduler on another host
            credentials = channel_credentials(config.tls)
            channel = aio.secure_channel(config.scheduler, credentials, options, None, interceptors)
        else:
            channel = aio.insecure_channel(config.scheduler, options, None, interceptors)
        tokenizer_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        link = SchedulerLink(stub, config.scheduler, tokenizer_id, arena)
        admission = Admission(
            tokenizer, name, link, arena, TokenizerTelemetry(tracing, metrics, name)
        )
        servicer = GenerationServicer(admission)
        keys = ApiKeys(config.api_key)
        if not keys.required:
            log.warning(
                "no API key (--api-key or TANDEM_API_KEY): the API is open to anyone who can "
                "reach %s",
                config.host,
            )
        http = None
        if config.http_port:
            from services.tokenizer.http.app import create_app
            from services.tokenizer.http.server import HttpServer

            app = create_app(
                admission,
                keys,
                metrics.registry,
                config.http_body_timeout_s,
                config.tool_call_format,
                config.reasoning_format,
            )
            http = HttpServer(app, config.host, config.http_port, config.tls, grace_s=GRACE_S)

        async def start() -> None:
            await link.start()
            if http is not None:
                await http.start()

        async def drain() -> None:
            if http is not None:
                await http.stop()

        async def stop() -> None:
            await link.stop()
            await channel.close()
            if arena is not None:
                arena.close()

        return Service(
            register=lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, s),
            service_names=[generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
            metrics=metrics.registry,
            start=start,
            drain=drain,
            stop=stop,
            grace_s=GRACE_S,
            interceptors=[AuthInterceptor(keys)] if keys.required else [],
            tls=config.tls,
            reuse_port=True,  # several tokenizer processes may share the public port
            admin_address=f"127.0.0.1:{config.admin_port}" if config.admin_port else None,
        )

    return await run_service("tokenizer", config.address, config.telemetry, build)


if __name__ == "__main__":
    sys.exit(main("tokenizer", TokenizerConfig, serve, __doc__))
