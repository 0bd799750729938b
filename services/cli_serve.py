"""`tandem serve`: the whole pipeline on this machine — worker, scheduler and tokenizers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from engine import registry
from services.cli_args import add_engine_args

if TYPE_CHECKING:
    from services.launcher import ProcessSpec


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="start the tokenizer, scheduler and worker processes and serve the gRPC API",
        description="Start the pipeline locally: one worker, one scheduler and N tokenizers, "
        "supervised (a crashed process is restarted) until Ctrl-C or SIGTERM.",
    )
    p.add_argument(
        "--model",
        default=registry.DEFAULT_MODEL,
        help=f"model name or path (default {registry.DEFAULT_MODEL})",
    )
    add_engine_args(p)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decodes")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the worker's CPU threads for batched steps and prefills (default: all cores; "
        "small decode steps leave one core to the other processes)",
    )
    p.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.9,
        help="share of the GPU for weights, activations and KV cache (with --kv-cache-mb 0)",
    )
    p.add_argument("--host", default="127.0.0.1", help="public address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="public port (default 50051)")
    p.add_argument("--tokenizers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="new tokens per step")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="waiting requests beyond which new ones get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-wait-us",
        type=float,
        default=0.0,
        help="micro-batch window while the worker is idle (0: off)",
    )
    p.add_argument(
        "--kv-cache-mb",
        type=int,
        default=1024,
        help="KV cache memory in MiB (0 on CUDA: sized by --gpu-memory-fraction)",
    )
    p.add_argument(
        "--transport",
        choices=["shm", "grpc"],
        default="shm",
        help="hot path through shared memory (default) or gRPC",
    )
    p.add_argument("--scheduler-port", type=int, default=0, help="internal (0: any free port)")
    p.add_argument("--worker-port", type=int, default=0, help="internal (0: any free port)")
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds each process may take to become healthy",
    )
    _add_telemetry_arguments(p)
    p.add_argument(
        "--demo",
        metavar="PROMPT",
        help="once serving, stream a reply to this chat prompt (what `make run` does)",
    )
    p.set_defaults(func=_serve)


def _add_telemetry_arguments(p: argparse.ArgumentParser) -> None:
    from services.telemetry.config import PROTOCOLS, SAMPLERS

    g = p.add_argument_group(
        "observability",
        "Unset tracing flags leave each process to read the standard OTEL_* variables itself.",
    )
    g.add_argument(
        "--otlp-endpoint",
        help="send traces over OTLP here, e.g. http://localhost:4317 "
        "(default $OTEL_EXPORTER_OTLP_ENDPOINT; none: tracing off)",
    )
    g.add_argument("--otlp-protocol", choices=PROTOCOLS, help="default grpc")
    g.add_argument("--trace-sampler", choices=SAMPLERS, help="default parentbased_always_on")
    g.add_argument("--trace-sampler-arg", type=float, help="ratio of the traceidratio samplers")
    g.add_argument(
        "--service-name-prefix",
        help="service names are PREFIX-tokenizer, PREFIX-scheduler, PREFIX-worker "
        "(default $OTEL_SERVICE_NAME, or tandem)",
    )
    g.add_argument(
        "--no-metrics",
        action="store_true",
        help="no Prometheus endpoints (by default each process serves /metrics on a free port)",
    )
    g.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoints")


def _telemetry_args(args: argparse.Namespace, role: str, metrics_port: int) -> list[str]:
    out = ["--service-name", f"{args.service_name_prefix}-{role}"]
    for flag, value in (
        ("--otlp-endpoint", args.otlp_endpoint),
        ("--otlp-protocol", args.otlp_protocol),
        ("--trace-sampler", args.trace_sampler),
        ("--trace-sampler-arg", args.trace_sampler_arg),
    ):
        if value is not None:
            out += [flag, str(value)]
    if metrics_port:
        out += ["--metrics-port", str(metrics_port), "--metrics-host", args.metrics_host]
    return out


def _metrics_url(args: argparse.Namespace, port: int) -> str:
    return f"http://{args.metrics_host}:{port}/metrics" if port else ""


def _specs(args: argparse.Namespace) -> list[ProcessSpec]:
    from services.launcher import ProcessSpec, free_port

    def metrics_port() -> int:
        return 0 if args.no_metrics else free_port(args.metrics_host)

    worker_port = args.worker_port or free_port()
    scheduler_port = args.scheduler_port or free_port()
    common = ["--model", args.model, "--home", str(args.home)]
    worker_metrics, scheduler_metrics = metrics_port(), metrics_port()
    specs = [
        ProcessSpec(
            "worker",
            "services.worker",
            [
                *common,
                "--port",
                str(worker_port),
                "--device",
                args.device,
                "--dtype",
                args.dtype,
                "--quantize",
                args.quantize,
                "--kv-cache-mb",
                str(args.kv_cache_mb),
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--gpu-memory-fraction",
                str(args.gpu_memory_fraction),
                *(["--enforce-eager"] if args.enforce_eager else []),
                *(["--threads", str(args.threads)] if args.threads else []),
                *_telemetry_args(args, "worker", worker_metrics),
            ],
            f"127.0.0.1:{worker_port}",
            stop_grace_s=10.0,
            metrics_url=_metrics_url(args, worker_metrics),
        ),
        ProcessSpec(
            "scheduler",
            "services.scheduler",
            [
                "--port",
                str(scheduler_port),
                "--worker",
                f"127.0.0.1:{worker_port}",
                "--transport",
                args.transport,
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
                "--max-queued-requests",
                str(args.max_queued_requests),
                "--max-wait-us",
                str(args.max_wait_us),
                *_telemetry_args(args, "scheduler", scheduler_metrics),
            ],
            f"127.0.0.1:{scheduler_port}",
            stop_grace_s=10.0,
            metrics_url=_metrics_url(args, scheduler_metrics),
        ),
    ]
    for i in range(1, args.tokenizers + 1):
        admin = free_port()
        tokenizer_metrics = metrics_port()
        specs.append(
            ProcessSpec(
                f"tokenizer-{i}",
                "services.tokenizer",
                [
                    *common,
                    "--host",
                    args.host,
                    "--port",
                    str(args.port),
                    "--admin-port",
                    str(admin),
                    "--scheduler",
                    f"127.0.0.1:{scheduler_port}",
                    "--transport",
                    args.transport,
                    *_telemetry_args(args, "tokenizer", tokenizer_metrics),
                ],
                f"127.0.0.1:{admin}",
                stop_grace_s=15.0,
                metrics_url=_metrics_url(args, tokenizer_metrics),
            )
        )
    return specs


def _serve(args: argparse.Namespace) -> int:
    # The launcher forks its children while gRPC (health checks) runs in it: skip grpc's fork
    # handlers, which the children never need (they exec a fresh interpreter).
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from services.server import run, setup_logging

    if args.tokenizers < 1:
        print("tandem serve: error: --tokenizers must be at least 1", file=sys.stderr)
        return 2
    # Read here, the launcher's edge: its children are given names, not this variable.
    args.service_name_prefix = (
        args.service_name_prefix or os.environ.get("OTEL_SERVICE_NAME") or "tandem"
    )
    if args.trace_sampler_arg is not None and not 0.0 <= args.trace_sampler_arg <= 1.0:
        print("tandem serve: error: --trace-sampler-arg must be in [0, 1]", file=sys.stderr)
        return 2
    registry.resolve(args.model, args.home)  # fetch a named model once, before any process starts
    setup_logging("launcher")
    return run(lambda: _supervise(args))


async def _supervise(args: argparse.Namespace) -> int:
    from services.launcher import LaunchFailed, Supervisor, child_env

    log = logging.getLogger("tandem.launcher")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    specs = _specs(args)
    supervisor = Supervisor(specs, child_env(), args.ready_timeout)
    try:
        starting = asyncio.create_task(supervisor.start_all())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            starting.cancel()
            return 130
        starting.result()
        for spec in specs:
            if spec.metrics_url:
                log.info("%s metrics at %s", spec.name, spec.metrics_url)
                print(f"metrics {spec.name} {spec.metrics_url}", flush=True)
        address = f"{args.host}:{args.port}"
        print(
            f"tandem serving {args.model} at {address} "
            f"({args.tokenizers} tokenizer(s), device {args.device})",
            flush=True,
        )
        if args.demo:
            await _demo(address, args.demo)
        await stop.wait()
        log.info("shutting down")
        return 0
    except LaunchFailed as err:
        log.error("%s", err)
        return 1
    finally:
        await supervisor.stop_all()


async def _demo(address: str, prompt: str) -> None:
    from services.client import TandemClient

    print(f"\n> {prompt}\n", flush=True)
    async with TandemClient(address) as client:
        messages = [{"role": "user", "content": prompt}]
        async for delta in client.generate(messages=messages, max_tokens=128, temperature=0.0):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            if delta.finish_reason and delta.usage is not None:
                print(
                    f"\n\n[{delta.usage.completion_tokens} tokens, {delta.finish_reason}] "
                    "still serving; Ctrl-C stops",
                    flush=True,
                )
