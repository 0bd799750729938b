"""`tandem serve`: the whole pipeline on this machine — worker, scheduler and tokenizers.

Its settings are made of the processes' own (services/settings.py): every setting of the
worker's engine and of the scheduler's policy is a flag here and a key of `--config FILE`. The
launcher writes each process's settings to a file and starts it with `--config FILE`, so a
process started by `tandem serve` reads its settings exactly as one started by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import EngineError
from services.address import join_address
from services.scheduler.config import SchedulerProcessConfig, SchedulingPolicy
from services.settings import flag, parse, write_file
from services.telemetry.config import TelemetryConfig, TracingSettings
from services.tokenizer.config import EdgeSettings, TokenizerConfig
from services.worker.config import EngineSettings, WorkerConfig

if TYPE_CHECKING:
    from services.launcher import ProcessSpec, Supervisor

Port = Callable[[], int]  # a free port, picked when called
ChildConfig = WorkerConfig | SchedulerProcessConfig | TokenizerConfig

DESCRIPTION = (
    "Start the pipeline locally: one worker, one scheduler and N tokenizers, supervised (a "
    "crashed process is restarted) until Ctrl-C or SIGTERM. Every flag can also be a key of "
    "--config FILE (YAML or JSON)."
)


@dataclass(frozen=True)
class ServeTelemetry:
    service_name_prefix: str = flag(
        "tandem",
        "service names are PREFIX-tokenizer, PREFIX-scheduler, PREFIX-worker",
        env="OTEL_SERVICE_NAME",
    )
    tracing: TracingSettings = field(default_factory=TracingSettings)
    metrics: bool = flag(True, "each process serves Prometheus /metrics on a free port")
    metrics_host: str = flag("127.0.0.1", "address of the metrics endpoints")


@dataclass(frozen=True)
class ServeConfig(EdgeSettings):
    tokenizers: int = flag(1, "tokenizer processes sharing the public port")
    scheduler_port: int = flag(0, "the scheduler's port (0: a free one)")
    worker_port: int = flag(0, "the worker's port (0: a free one)")
    ready_timeout: float = flag(300.0, "seconds each process may take to become healthy")
    demo: str = flag("", "once serving, stream a reply to this chat prompt (what `make run` does)")
    engine: EngineSettings = field(default_factory=EngineSettings)
    policy: SchedulingPolicy = field(default_factory=SchedulingPolicy)
    telemetry: ServeTelemetry = field(default_factory=ServeTelemetry)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizers < 1:
            raise ValueError("--tokenizers must be at least 1")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="start the tokenizer, scheduler and worker processes and serve the gRPC API",
        add_help=False,  # the flags are ServeConfig's, parsed (and explained) by _serve
    )
    p.set_defaults(func=_serve, user_errors=(EngineError,), forwards=True)


def parse_serve(argv: list[str]) -> ServeConfig:
    return parse(ServeConfig, argv, os.environ, prog="tandem serve", description=DESCRIPTION)


def _serve(args: argparse.Namespace) -> int:
    # The launcher forks its children while gRPC (health checks) runs in it: skip grpc's fork
    # handlers, which the children never need (they exec a fresh interpreter).
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from engine import registry
    from services.process import run, setup_logging

    try:
        # The global `tandem --home` first: a --home of serve's own comes later and wins.
        config = parse_serve(["--home", str(args.home), *args.argv])
    except ValueError as err:
        print(f"tandem serve: error: {err}", file=sys.stderr)
        return 2
    # Fetch a named model once, before any process starts.
    registry.resolve(config.model.model, Path(config.model.home).expanduser())
    if config.chat_template:
        from engine.tokenizer import load_chat_template

        load_chat_template(config.chat_template)  # a template that does not compile stops here
        given = Path(config.chat_template).expanduser()
        if given.is_file():  # each tokenizer reads it too, from its settings file
            config = replace(config, chat_template=str(given.resolve()))
    setup_logging("launcher")
    return run(lambda: _supervise(config))


def _telemetry(config: ServeConfig, role: str, port: Port) -> TelemetryConfig:
    t = config.telemetry
    return TelemetryConfig(
        service_name=f"{t.service_name_prefix}-{role}",
        tracing=t.tracing,
        metrics_port=port() if t.metrics else 0,
        metrics_host=t.metrics_host,
    )


def worker_config(config: ServeConfig, port: Port) -> WorkerConfig:
    return WorkerConfig(
        model=config.model,
        port=config.worker_port or port(),
        max_num_seqs=config.policy.max_num_seqs,
        max_num_batched_tokens=config.policy.on_device(config.engine.device).largest_step_tokens,
        engine=config.engine,
        telemetry=_telemetry(config, "worker", port),
    )


def scheduler_config(config: ServeConfig, worker: str, port: Port) -> SchedulerProcessConfig:
    return SchedulerProcessConfig(
        port=config.scheduler_port or port(),
        worker=worker,
        transport=config.transport,
        policy=config.policy,
        telemetry=_telemetry(config, "scheduler", port),
    )


def tokenizer_config(config: ServeConfig, scheduler: str, port: Port) -> TokenizerConfig:
    edge = {f.name: getattr(config, f.name) for f in fields(EdgeSettings)}
    telemetry = _telemetry(config, "tokenizer", port)
    return TokenizerConfig(**edge, admin_port=port(), scheduler=scheduler, telemetry=telemetry)


async def start_children(
    supervisor: Supervisor, config: ServeConfig, run_dir: Path
) -> tuple[ServeConfig, list[ProcessSpec]]:
    """Start worker, scheduler and tokenizers in turn, each made on ports picked just before it
    starts (none the config names or another was given), for the address of the one started
    before it; their settings files in run_dir. Returns the config as served (`--port 0`: the
    public port picked) and the processes."""
    from services.launcher import ProcessSpec

    named = (config.port, config.http_port, config.scheduler_port, config.worker_port)
    supervisor.reserved.update(p for p in named if p)

    def spec(name: str, child_of: Callable[[Port], ChildConfig], port: Port) -> ProcessSpec:
        child = child_of(port)
        path = write_file(child, run_dir / f"{name}.json")
        t = child.telemetry
        url = (
            f"http://{join_address(t.metrics_host, t.metrics_port)}/metrics"
            if t.metrics_port
            else ""
        )
        module, health, grace = f"services.{name}", child.address, 10.0
        if isinstance(child, TokenizerConfig):  # they share an address: health on a port of its own
            module, health, grace = "services.tokenizer", f"127.0.0.1:{child.admin_port}", 15.0
        return ProcessSpec(name, module, ["--config", str(path)], health, grace, url)

    worker = await supervisor.start(partial(spec, "worker", partial(worker_config, config)))
    scheduler_of = partial(scheduler_config, config, worker.health_address)
    scheduler = await supervisor.start(partial(spec, "scheduler", scheduler_of))
    public = config.port

    def tokenizer_of(first: bool, port: Port) -> TokenizerConfig:
        # `--port 0`: the public port is one of the first tokenizer's picked ports, so that one
        # another program takes before the tokenizer binds it (after the worker has loaded) is
        # picked again like any other; the later tokenizers share the port it bound.
        nonlocal public
        if first and not config.port:
            public = port()
        return tokenizer_config(replace(config, port=public), scheduler.health_address, port)

    tokenizers = [
        await supervisor.start(partial(spec, f"tokenizer-{i}", partial(tokenizer_of, i == 1)))
        for i in range(1, config.tokenizers + 1)
    ]
    return replace(config, port=public), [worker, scheduler, *tokenizers]


async def _supervise(config: ServeConfig) -> int:
    from services.client_types import TandemError
    from services.launcher import LaunchFailed, Supervisor
    from services.listen import CannotListen, bind_error
    from services.process import stop_event_on_signals

    log = logging.getLogger("tandem.launcher")
    supervisor = Supervisor({"PYTHONUNBUFFERED": "1", **os.environ}, config.ready_timeout)
    ports = (("--port", config.port, "a free one"), ("--http-port", config.http_port, "no HTTP"))
    for option, port, zero in ports:
        # Without SO_REUSEPORT, which the tokenizers share these ports by: a process already on
        # one refuses this, where the tokenizers would have joined it.
        if port and (err := bind_error(config.host, port)) is not None:
            why = CannotListen(join_address(config.host, port), err)
            log.error("%s %d: %s; give another %s (0: %s)", option, port, why, option, zero)
            return 1
    stop = stop_event_on_signals()
    run_dir = Path(tempfile.mkdtemp(prefix="tandem-serve-"))
    try:
        starting = asyncio.create_task(start_children(supervisor, config, run_dir))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            starting.cancel()
            return 130
        config, specs = starting.result()  # with the public port picked, where it was 0
        for s in specs:
            if s.metrics_url:
                log.info("%s metrics at %s", s.name, s.metrics_url)
                print(f"metrics {s.name} {s.metrics_url}", flush=True)
        if config.http_port:
            scheme = "https" if config.tls.enabled else "http"
            print(f"http {scheme}://{join_address(config.host, config.http_port)}/v1", flush=True)
        if not config.api_key:
            log.warning(
                "no --api-key (or TANDEM_API_KEY): the API is open to anyone who can reach %s",
                config.host,
            )
        named = f" as {config.served_model_name!r}" if config.served_model_name else ""
        print(
            f"tandem serving {config.model.model}{named} at {config.address} "
            f"({config.tokenizers} tokenizer(s), device {config.engine.device})",
            flush=True,
        )
        if config.demo:
            try:
                await _demo(config)
            except TandemError as err:
                log.error("the demo request failed: %s", err)
                return 1
        await stop.wait()
        log.info("shutting down")
        return 0
    except LaunchFailed as err:
        log.error("%s", err)
        return 1
    finally:
        await supervisor.stop_all()
        shutil.rmtree(run_dir, ignore_errors=True)


async def _demo(config: ServeConfig) -> None:
    from services.client import TandemClient
    from services.client_types import Connection

    prompt = config.demo
    t = config.tls
    connection = Connection(
        api_key=config.api_key[0] if config.api_key else None,
        tls=t.enabled,
        ssl_ca_certs=t.ssl_ca_certs or None,
        ssl_certfile=(t.ssl_certfile or None) if t.ssl_ca_certs else None,
        ssl_keyfile=(t.ssl_keyfile or None) if t.ssl_ca_certs else None,
    )
    print(f"\n> {prompt}\n", flush=True)
    async with TandemClient(config.address, connection=connection) as client:
        messages = [{"role": "user", "content": prompt}]
        async for delta in client.generate(messages=messages, max_tokens=128, temperature=0.0):
            print(delta.text, end="", flush=True)
            if delta.finish_reason and delta.usage is not None:
                print(
                    f"\n\n[{delta.usage.completion_tokens} tokens, {delta.finish_reason}] "
                    "still serving; Ctrl-C stops",
                    flush=True,
                )
